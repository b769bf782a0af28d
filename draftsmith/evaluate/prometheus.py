"""Prometheus text exposition format, the little of it a vLLM server's ``/metrics`` uses.

One sample per line, ``name{label="value",...} value [timestamp]``; ``#`` lines are help and
type comments. No client library needed for reading counters.
"""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples ``(name, labels, value)`` of Prometheus text exposition format.

    Comment lines (``# HELP``, ``# TYPE``) and blank lines are skipped; label values are
    unescaped for ``\\\\``, ``\\"`` and ``\\n``.
    """
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, label_text, value = match.groups()
        labels = {
            key: raw.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")
            for key, raw in _LABEL.findall(label_text or "")
        }
        try:
            samples.append((name, labels, float(value)))
        except ValueError:
            continue
    return samples
