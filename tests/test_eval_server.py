"""Online evaluation: spec-decode counters, and a real vLLM server on loopback.

The counter tests need no engine. The two server tests (marked ``vllm``) start one
healthy server with ngram drafting on the tiny target and one that fails to start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from draftsmith.evaluate.counters import (
    SpecCounters,
    from_offline_metrics,
    from_prometheus_text,
    tokens_per_step,
)
from draftsmith.evaluate.prometheus import parse_prometheus
from draftsmith.evaluate.server import (
    ServerError,
    check_loopback,
    cli_flags,
    process_group_alive,
    stop_process_group,
    vllm_server,
)

# As vLLM 0.32 writes them (HELP/TYPE lines, `_created` gauges, labels in this order).
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 15.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="tiny"} 5.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="tiny"} 1.7954007952056756e+09
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 29.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="tiny"} 15.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 11.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="tiny"} 3.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="tiny",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="tiny",position="0"} 2.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_created gauge
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="t",position="0"} 1.7e9
"""

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
ENGINE = dict(
    dtype="float32",
    gpu_memory_utilization=0.3,
    max_model_len=512,
    enforce_eager=True,
    max_num_seqs=4,
    disable_log_stats=False,
)


def test_prometheus_text_sums_engines_and_reads_positions():
    c = from_prometheus_text(METRICS)
    assert c == SpecCounters(20, 44, 14, [10, 2, 2])
    assert c.acceptance_length() == pytest.approx(1 + 14 / 20)
    assert c.per_position() == pytest.approx([0.5, 0.1, 0.1])
    assert from_prometheus_text("") == SpecCounters()


def test_prometheus_parser_handles_escapes_and_comments():
    text = '# HELP x y\nm_total{a="q\\"uo,te}",b="2"} 3.5 1700000000\nbad line\n'
    assert parse_prometheus(text) == [("m_total", {"a": 'q"uo,te}', "b": "2"}, 3.5)]


def test_delta_pads_per_position_and_handles_no_drafts():
    before = SpecCounters(4, 10, 3, [2, 1])
    after = SpecCounters(10, 28, 9, [5, 2, 1])
    assert after - before == SpecCounters(6, 18, 6, [3, 1, 1])
    assert before - after == SpecCounters(-6, -18, -6, [-3, -1, -1])
    empty = SpecCounters()
    assert empty.acceptance_length() is None and empty.per_position() == []
    assert (after - before).to_dict() == {
        "num_drafts": 6,
        "num_draft_tokens": 18,
        "num_accepted_tokens": 6,
        "accepted_per_pos": [3, 1, 1],
    }


def test_tokens_per_step():
    assert tokens_per_step(120, 40) == pytest.approx(1.5)
    assert tokens_per_step(100, 0) == 1.0
    assert tokens_per_step(0, 0) is None


def test_offline_metrics_from_vllm_reader_classes():
    reader = pytest.importorskip("vllm.v1.metrics.reader")
    labels = [{"engine": "0", "model_name": "m"}, {"engine": "1", "model_name": "m"}]
    metrics = [
        reader.Gauge(name="vllm:num_requests_running", labels=labels[0], value=3.0),
        reader.Counter(name="vllm:spec_decode_num_drafts", labels=labels[0], value=7),
        reader.Counter(name="vllm:spec_decode_num_drafts", labels=labels[1], value=3),
        reader.Counter(name="vllm:spec_decode_num_draft_tokens", labels=labels[0], value=21),
        reader.Counter(name="vllm:spec_decode_num_accepted_tokens", labels=labels[0], value=9),
        reader.Counter(name="vllm:spec_decode_num_accepted_tokens", labels=labels[1], value=1),
        reader.Counter(name="vllm:generation_tokens", labels=labels[0], value=99),
        reader.Vector(
            name="vllm:spec_decode_num_accepted_tokens_per_pos", labels=labels[0], values=[5, 3, 1]
        ),
        reader.Vector(
            name="vllm:spec_decode_num_accepted_tokens_per_pos", labels=labels[1], values=[1]
        ),
    ]
    assert from_offline_metrics(metrics) == SpecCounters(10, 21, 10, [6, 3, 1])
    assert from_offline_metrics([]) == SpecCounters()


def test_cli_flags_and_loopback_only():
    flags = cli_flags(
        dict(ENGINE, model="x", seed=None, enforce_eager=False, speculative_config=NGRAM)
    )
    assert flags[:4] == ["--dtype", "float32", "--gpu-memory-utilization", "0.3"]
    assert "--no-enforce-eager" in flags and "--model" not in flags and "--seed" not in flags
    assert not any("log-stats" in f for f in flags)
    assert json.loads(flags[flags.index("--speculative-config") + 1]) == NGRAM
    with pytest.raises(ValueError, match="counters"):
        cli_flags({"disable_log_stats": True})
    check_loopback("127.0.0.1")
    check_loopback("localhost")
    check_loopback("::1")
    for host in ("0.0.0.0", "10.1.2.3", "example.com"):
        with pytest.raises(ValueError, match="loopback"):
            check_loopback(host)


def test_stop_process_group_kills_children(tmp_path):
    # A parent that ignores SIGTERM and a child of its own, both in a new session.
    script = "import signal,subprocess,time;signal.signal(signal.SIGTERM,signal.SIG_IGN);"
    script += "subprocess.Popen(['sleep','600']);print('ready',flush=True);time.sleep(600)"
    proc = subprocess.Popen(
        [sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"  # both processes exist from here on
    assert process_group_alive(proc.pid)
    stop_process_group(proc, grace=1.0)
    assert proc.poll() is not None and not process_group_alive(proc.pid)


@pytest.mark.vllm
def test_server_counts_ngram_drafts_and_stops(tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"
    chats = [
        [{"role": "user", "content": f"Say the word {w} again and again."}]
        for w in ("apple", "river", "seven", "blue")
    ]
    t0 = time.monotonic()
    with vllm_server(str(tiny_model_dir), ENGINE, NGRAM, log_path=log) as server:
        started = time.monotonic() - t0
        assert server.url.startswith("http://127.0.0.1:")
        before = server.metrics()
        results = server.complete(chats, max_tokens=32, temperature=0.0, concurrency=2)
        after = server.metrics()
        pgid = server.pgid
        assert process_group_alive(pgid)
    assert not process_group_alive(pgid), "the server's process group outlived the context"
    assert server.process.returncode is not None

    assert len(results) == 4 and results.seconds > 0
    for r in results:
        assert r["completion_tokens"] == 32 == len(r["token_ids"])
        assert isinstance(r["text"], str) and r["latency"] > 0
    delta = after - before
    assert delta.num_drafts > 0, f"no ngram drafts in {started:.0f} s run: {delta}"
    assert 0 <= delta.num_accepted_tokens <= delta.num_draft_tokens
    assert delta.num_draft_tokens <= 3 * delta.num_drafts
    assert len(delta.accepted_per_pos) == 3
    assert sum(delta.accepted_per_pos) == delta.num_accepted_tokens
    output = sum(r["completion_tokens"] for r in results)
    assert tokens_per_step(output, delta.num_accepted_tokens) >= 1.0
    assert "--speculative-config" in log.read_text().splitlines()[0]


@pytest.mark.vllm
def test_server_that_cannot_start_raises_with_log_tail(tmp_path):
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": ')
    with pytest.raises(ServerError) as info:
        with vllm_server(str(model), ENGINE, None, log_path=tmp_path / "log"):
            pytest.fail("a broken model must not serve")
    message = str(info.value)
    assert "exited with code" in message
    assert "not a valid JSON file" in message  # from the server's own log
    assert os.path.exists(tmp_path / "log")
