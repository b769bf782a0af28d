"""vLLM's speculative-decoding counters, read offline or from a server's ``/metrics``.

vLLM 0.32 counts four things per engine (``vllm/v1/spec_decode/metrics.py``), each a
Prometheus counter labelled ``model_name`` and ``engine``:

- ``vllm:spec_decode_num_drafts``: verification steps that carried a draft,
- ``vllm:spec_decode_num_draft_tokens``: draft tokens proposed,
- ``vllm:spec_decode_num_accepted_tokens``: draft tokens accepted,
- ``vllm:spec_decode_num_accepted_tokens_per_pos``: accepted tokens at each draft
  position, one counter per ``position`` label ("0", "1", ...).

On a server's ``/metrics`` they carry the ``_total`` suffix. ``LLM.get_metrics()``
(``vllm/v1/metrics/reader.py``) gives ``Counter`` objects (``.value``) for the first
three and one ``Vector`` (``.values``, indexed by position) per engine for the last.
Every reading is summed over engines and other labels.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from draftsmith.evaluate.prometheus import parse_prometheus

PREFIX = "vllm:spec_decode_"
DRAFTS = PREFIX + "num_drafts"
DRAFT_TOKENS = PREFIX + "num_draft_tokens"
ACCEPTED = PREFIX + "num_accepted_tokens"
ACCEPTED_PER_POS = PREFIX + "num_accepted_tokens_per_pos"
SCALARS = {DRAFTS: "num_drafts", DRAFT_TOKENS: "num_draft_tokens", ACCEPTED: "num_accepted_tokens"}


@dataclass
class SpecCounters:
    """One reading (or the difference of two readings) of the spec-decode counters."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        """What was counted between `other` (the earlier reading) and `self`."""
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine = _padded(self.accepted_per_pos, n)
        theirs = _padded(other.accepted_per_pos, n)
        return SpecCounters(
            num_drafts=self.num_drafts - other.num_drafts,
            num_draft_tokens=self.num_draft_tokens - other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - other.num_accepted_tokens,
            accepted_per_pos=[a - b for a, b in zip(mine, theirs, strict=True)],
        )

    def acceptance_length(self) -> float | None:
        """Mean tokens per drafted step: ``1 + accepted / drafts`` (None without drafts)."""
        if self.num_drafts <= 0:
            return None
        return 1 + self.num_accepted_tokens / self.num_drafts

    def per_position(self) -> list[float]:
        """Acceptance rate at each draft position (``[]`` without drafts)."""
        if self.num_drafts <= 0:
            return []
        return [a / self.num_drafts for a in self.accepted_per_pos]

    def to_dict(self) -> dict:
        """Plain JSON-ready dict with the four fields."""
        return asdict(self)


def _padded(values: list[int], n: int) -> list[int]:
    return list(values) + [0] * (n - len(values))


def _add_at(values: list[int], pos: int, amount: int) -> None:
    values.extend([0] * (pos + 1 - len(values)))
    values[pos] += amount


def from_offline_metrics(metrics: Iterable) -> SpecCounters:
    """Counters from ``vllm.LLM(..., disable_log_stats=False).get_metrics()``.

    Duck-typed on vLLM's reader classes: ``Counter`` has ``.value``, ``Vector`` has
    ``.values``; every label set (engine index, model name) is summed.
    """
    out = SpecCounters()
    for metric in metrics:
        name = getattr(metric, "name", None)
        if name in SCALARS:
            attr = SCALARS[name]
            setattr(out, attr, getattr(out, attr) + int(metric.value))
        elif name == ACCEPTED_PER_POS:
            for pos, value in enumerate(metric.values):
                _add_at(out.accepted_per_pos, pos, int(value))
    return out


def from_prometheus_text(text: str) -> SpecCounters:
    """Counters from a vLLM server's ``/metrics`` (names with the ``_total`` suffix).

    Per-position counts come from ``vllm:spec_decode_num_accepted_tokens_per_pos_total``
    with a ``position`` label; all other labels (``model_name``, ``engine``) are summed.
    """
    out = SpecCounters()
    for name, labels, value in parse_prometheus(text):
        if not name.endswith("_total"):
            continue
        base = name[: -len("_total")]
        if base in SCALARS:
            attr = SCALARS[base]
            setattr(out, attr, getattr(out, attr) + int(value))
        elif base == ACCEPTED_PER_POS and "position" in labels:
            _add_at(out.accepted_per_pos, int(labels["position"]), int(value))
    return out


def tokens_per_step(output_tokens: int, accepted_tokens: int) -> float | None:
    """Output tokens per target verification step: ``output / (output - accepted)``.

    Every step emits one token of the target's own plus the drafts it accepted, so the
    steps are ``output - accepted``. None when that is not positive (no output).
    """
    steps = output_tokens - accepted_tokens
    if steps <= 0:
        return None
    return output_tokens / steps
