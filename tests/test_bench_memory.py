"""`draftsmith bench-memory` on short rows: one EAGLE-3 training step (TTT 2, blockwise
attention) at 512, 1024 and 2048 tokens. Linear memory means each doubling adds about what
the one before added per token; a [T, T] tensor would add twice as much per token with each
doubling. Run in a subprocess: the bench reads the resident set and sets glibc's mmap
threshold, neither of which a test process should share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from draftsmith.bench.memory import main

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str) -> dict:
    cmd = [sys.executable, "-m", "draftsmith.cli", "bench-memory", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def test_training_step_memory_grows_linearly_with_the_row() -> None:
    out = bench("--kinds=[eagle3]", "--rows=[512,1024,2048]", "--ttt_steps=2",
                "--attention=blockwise", "--storage_dtype=fp8_e4m3")  # fmt: skip
    rows = out["rows"]
    assert [r["row_tokens"] for r in rows] == [512, 1024, 2048]
    assert all(r["peak_mib"] > 0 for r in rows)
    first, second = (r["added_bytes_per_added_token"] for r in rows[1:])
    assert 0 < second <= 1.25 * first, rows  # quadratic: second ~ 2x first
    assert rows[-1]["bytes_per_token"] <= 1.1 * rows[0]["bytes_per_token"], rows
    # fp8 states of the tiny target: 4 layers x 128 x 1 byte, 4 x 4 scale bytes, id, mask
    assert out["disk"]["bytes_per_token"] == 4 * 128 + 16 + 5


def test_bench_memory_refuses_an_unknown_kind_in_one_line(capsys) -> None:
    assert main(["--kinds=[medusa]"]) == 2  # checked before anything is measured
    lines = [x for x in capsys.readouterr().err.strip().splitlines() if x]
    assert len(lines) == 1 and "kinds of eagle3 / dflash" in lines[0], lines
