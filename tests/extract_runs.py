"""What the extraction tests share: a few chats and running `draftsmith extract` as users do
(imported as `extract_runs`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHATS = [
    {
        "conversations": [
            {"from": "human", "value": "Name three primary colours."},
            {"from": "gpt", "value": "Red, yellow and blue."},
            {"from": "human", "value": "And secondary ones?"},
            {"from": "gpt", "value": "Orange, green and purple."},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Say hello in French."},
            {"role": "assistant", "content": "Bonjour !"},
            {"role": "user", "content": "And in German?"},
            {"role": "assistant", "content": "Hallo!"},
        ]
    },
]


def extract(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "draftsmith.extract", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
