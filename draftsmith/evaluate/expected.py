"""Expected acceptance: what vLLM should have accepted, from the target's probabilities of the
head's drafts on the replies it served.

Streams follow vLLM's steps (``drafters.protocol.Replica``): the chain at stream ``t`` (the
target state after token ``t``, fed token ``x[t+1]``) drafts ``x[t+2]`` .. ``x[t+k+1]``; with
``m`` drafts accepted, the next chain is at ``t + m + 1``. Draft ``j`` of a chain whose drafts
``0..j-1`` were accepted is accepted with probability (``acceptance``):

- greedy drafts (vLLM's ``draft_sample_method: greedy``, its default): the draft is the argmax
  ``d`` of the head's logits and vLLM takes its distribution as one-hot, so ``p_T(d)``: the
  target's probability of ``d`` at the request's temperature;
- probabilistic drafts: the draft is drawn from ``q = softmax(logits / T)`` and accepted with
  ``min(1, p_T / q)``, so ``sum_x min(p_T(x), q(x))``;
- at T = 0 either way: 1 when the greedy draft is the target's token, else 0.

Which chains a reply went through (where each began, how many drafts each had accepted) is
not in the reply when drafts are random. Given the served token ``x`` at a draft's position,
the draft was accepted with probability ``min(p_T(x), q(x)) / p_T(x)`` (an accepted draft is
the emitted token; a rejected one is replaced by a token drawn from ``max(0, p_T - q)``), and
the target's later tokens do not depend on it: ``replay`` walks the reply with that posterior,
a distribution over chain starts (for greedy drafts it is 0 or 1: accepted exactly when the
draft is the served token, one path, vLLM's). Per position it sums, over the chains alive,
the acceptance probability above (the compensator of vLLM's counts: served minus expected has
mean 0 for a lossless, correctly counting sampler), its variance ``p (1 - p)`` that sizes the
noise, and the posterior's own count of accepted drafts (at T = 0 it must equal vLLM's
counters: a mismatch says the head's replica is off, not vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

GAP = 0.05  # relative gap between served and expected acceptance that is flagged
Z_NOISE = 3.0  # a gap within this many standard errors is reported as noise
ROWS = 256  # rows of [rows, vocab] probabilities computed at once


@dataclass
class Expected:
    """Counts of one replay, summed over replies (the vLLM counters' shape)."""

    num_drafts: float = 0.0
    """Chains walked (expected number when drafts are random)."""
    accepted_per_pos: list[float] = field(default_factory=list)
    """Drafts the replay found accepted in the served replies, per position (their posterior
    expectation when drafts are random)."""
    expected_per_pos: list[float] = field(default_factory=list)
    """Sum of each alive draft's acceptance probability, per position."""
    variance: float = 0.0
    """Sum of ``p (1 - p)`` over the same terms (variance of the accepted count)."""

    def add(self, other: Expected) -> None:
        """Add another replay's counts to these."""
        k = max(len(self.accepted_per_pos), len(other.accepted_per_pos))

        def pad(values: list) -> list:
            return list(values) + [0.0] * (k - len(values))

        mine, theirs = pad(self.accepted_per_pos), pad(other.accepted_per_pos)
        self.accepted_per_pos = [a + b for a, b in zip(mine, theirs, strict=True)]
        mine, theirs = pad(self.expected_per_pos), pad(other.expected_per_pos)
        self.expected_per_pos = [a + b for a, b in zip(mine, theirs, strict=True)]
        self.num_drafts += other.num_drafts
        self.variance += other.variance

    def acceptance_length(self) -> float | None:
        """``1 + expected accepted / drafts``: the acceptance length vLLM should report."""
        return 1 + sum(self.expected_per_pos) / self.num_drafts if self.num_drafts else None


def acceptance(
    target_logits: Tensor,
    draft_logits: Tensor,
    tokens: Tensor,
    j: int,
    temperature: float,
    greedy: bool,
) -> tuple[Tensor, Tensor]:
    """(accept [L], posterior [L]) of draft ``j`` at every stream ``t`` (module docstring).

    target_logits [L, V] (row i predicts ``tokens[i + 1]``), draft_logits [L, V] (row t: draft
    j of the chain at t, proposing ``tokens[t + j + 2]``, scored by target row ``t + j + 1``),
    tokens [L]. ``accept``: the probability the draft is accepted; ``posterior``: the
    probability it was, given the served token. Rows without a token to check are 0.
    """
    n = tokens.numel()
    accept, posterior = torch.zeros(n), torch.zeros(n)
    for lo in range(0, max(n - j - 2, 0), ROWS):
        rows = torch.arange(lo, min(lo + ROWS, n - j - 2))
        served = tokens[rows + j + 2]
        logits = draft_logits[rows].float()
        if temperature == 0.0 or greedy:
            draft = logits.argmax(-1)
            hit = (draft == served).float()  # the served token: the target's, at T = 0
            posterior[rows] = hit
            if temperature == 0.0:
                accept[rows] = hit
                continue
            logp = torch.log_softmax(target_logits[rows + j + 1].float() / temperature, -1)
            accept[rows] = logp.gather(1, draft[:, None]).squeeze(1).exp()
            continue
        logp = torch.log_softmax(target_logits[rows + j + 1].float() / temperature, -1)
        logq = torch.log_softmax(logits / temperature, -1)
        accept[rows] = torch.minimum(logp, logq).exp().sum(-1).clamp(max=1.0)
        ratio = logq.gather(1, served[:, None]) - logp.gather(1, served[:, None])
        posterior[rows] = ratio.squeeze(1).clamp(max=0.0).exp()  # min(1, q(x) / p(x))
    return accept, posterior


def replay(accept: Tensor, posterior: Tensor, start: int, end: int | None = None) -> Expected:
    """Walk one served sequence as vLLM drafts it, over the posterior of its chains.

    accept, posterior [L, k] (``acceptance`` per draft j); start: the first chain's stream
    (prompt length - 1: the state of the last prompt token, fed the first reply token);
    end: the served sequence's length (default L). A chain starts only while the reply goes
    on past ``x[t+1]`` (``t + 2 < end``); its drafts are scored up to row L - 1, so rows past
    ``end`` (the target's greedy continuation at T = 0) count the drafts vLLM verified past
    the reply's last token, as its counters do.
    """
    n, k = accept.shape
    end = n if end is None else end
    out = Expected(accepted_per_pos=[0.0] * k, expected_per_pos=[0.0] * k)
    a, r = accept.tolist(), posterior.tolist()
    starts = [0.0] * (n + k + 2)  # probability that a chain starts at stream t
    starts[start] = 1.0
    for t in range(start, end - 2):
        alive = starts[t]
        if alive == 0.0:
            continue
        out.num_drafts += alive
        for j in range(k):
            if t + j + 2 >= n:
                break  # the request ended: nothing more was verified
            p = a[t][j]
            out.expected_per_pos[j] += alive * p
            out.variance += alive * p * (1 - p)
            kept = alive * r[t][j]
            out.accepted_per_pos[j] += kept
            starts[t + j + 1] += alive - kept  # rejected: the next chain after the target's token
            alive = kept
        else:
            starts[t + k + 1] += alive  # all k accepted, then the bonus token
    return out


def whole(x: float) -> float | int:
    """``x`` as an int when it is one (greedy replays count whole drafts)."""
    return int(x) if float(x).is_integer() else x


def compare(served: dict, expected: Expected) -> dict:
    """Served counters (results.json's ``counters``) against a replay: accepted tokens per
    draft both ways, the relative gap, its z-score and the verdict."""
    drafts = served["num_drafts"]
    got = served["num_accepted_tokens"] / drafts if drafts else None
    want = sum(expected.expected_per_pos) / expected.num_drafts if expected.num_drafts else None
    row = {
        "served_per_draft": got,
        "expected_per_draft": want,
        "served_per_pos": [a / drafts for a in served["accepted_per_pos"]] if drafts else None,
        "expected_per_pos": [e / expected.num_drafts for e in expected.expected_per_pos]
        if expected.num_drafts
        else None,
        "replayed_drafts": whole(expected.num_drafts),
        "replayed_accepted_per_pos": [whole(a) for a in expected.accepted_per_pos],
        "served_drafts": drafts,
        "relative_gap": None,
        "z": None,
        "flag": None,
    }
    if got is None or want is None:
        return row
    if want == 0:  # nothing could be accepted: any acceptance is a gap
        row.update(relative_gap=None if got else 0.0, flag="gap" if got else None)
        return row
    gap = (got - want) / want
    sd = expected.variance**0.5 / expected.num_drafts
    z = (got - want) / sd if sd > 0 else None  # None: no randomness (greedy), any gap is real
    flag = None
    if abs(gap) > GAP:
        flag = "gap" if z is None or abs(z) > Z_NOISE else "noise"
    row.update(relative_gap=gap, z=z, flag=flag)
    return row
