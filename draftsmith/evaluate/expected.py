"""Expected acceptance: what vLLM should have accepted, from the target's probabilities of
the head's drafts on the replies it served.

With greedy drafts (vLLM's ``draft_sample_method: greedy``) vLLM treats the draft
distribution as one-hot, so draft ``d`` is accepted with probability ``p_T(d)``: the target's
probability of ``d`` at the request's temperature (1 at T=0 when ``d`` is the target's token,
else 0). Along each served reply, this module replays vLLM's steps: a chain of k drafts at
stream ``t`` (the target state after token ``t``, fed token ``x[t+1]``) drafts ``x[t+2]`` ..
``x[t+k+1]``; ``m`` of them accepted, the next chain is at ``t + m + 1``. For each chain it
adds ``p_T`` of draft ``j`` while drafts ``0..j-1`` were accepted in the served reply (the
compensator of vLLM's counts: served minus expected has mean 0 for a lossless, correctly
counting sampler) and the variance ``p (1 - p)`` that sizes the noise.

The drafts are the head's own, recomputed in torch from the target's states (training's
teacher-forced unroll, ``drafters.ttt.ttt_unroll``: chain step ``j`` at stream ``t`` is
exactly vLLM's draft ``j`` whenever drafts ``0..j-1`` were accepted). The replay's own
count of accepted drafts should equal vLLM's: a mismatch says the replica is off, not vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

GAP = 0.05  # relative gap between served and expected acceptance that is flagged
Z_NOISE = 3.0  # a gap within this many standard errors is reported as noise


@dataclass
class Expected:
    """Counts of one replay, summed over replies (the vLLM counters' shape)."""

    num_drafts: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """Drafts the replay found accepted in the served replies, per position."""
    expected_per_pos: list[float] = field(default_factory=list)
    """Sum of ``p_T(draft)`` per position over chains still alive in the served reply."""
    variance: float = 0.0
    """Sum of ``p (1 - p)`` over the same terms (variance of the accepted count)."""

    def add(self, other: Expected) -> None:
        """Add another replay's counts to these."""
        k = max(len(self.accepted_per_pos), len(other.accepted_per_pos))

        def pad(values: list, zero):
            return list(values) + [zero] * (k - len(values))

        mine, theirs = pad(self.accepted_per_pos, 0), pad(other.accepted_per_pos, 0)
        self.accepted_per_pos = [a + b for a, b in zip(mine, theirs, strict=True)]
        mine, theirs = pad(self.expected_per_pos, 0.0), pad(other.expected_per_pos, 0.0)
        self.expected_per_pos = [a + b for a, b in zip(mine, theirs, strict=True)]
        self.num_drafts += other.num_drafts
        self.variance += other.variance


def replay(tokens: Tensor, drafts: Tensor, p_drafts: Tensor, start: int) -> Expected:
    """Walk one served sequence as vLLM drafts it.

    tokens [L] long: prompt + reply; drafts [L, k] long: target id of draft ``j`` at stream
    ``t`` (drafting ``tokens[t+j+2]``); p_drafts [L, k] float: ``p_T`` of that draft under the
    target given ``tokens[: t+j+2]``; start: the first chain's stream (prompt length - 1: the
    state of the last prompt token, fed the first reply token).
    """
    n, k = drafts.shape
    out = Expected(accepted_per_pos=[0] * k, expected_per_pos=[0.0] * k)
    toks, d, p = tokens.tolist(), drafts.tolist(), p_drafts.tolist()
    t = start
    while t + 2 < n:  # a draft is verified only while the reply goes on past x[t+1]
        out.num_drafts += 1
        m = 0
        for j in range(k):
            if t + j + 2 >= n:
                break
            out.expected_per_pos[j] += p[t][j]
            out.variance += p[t][j] * (1 - p[t][j])
            if d[t][j] != toks[t + j + 2]:
                break
            out.accepted_per_pos[j] += 1
            m += 1
        t += m + 1
    return out


def draft_probabilities(logits: Tensor, drafts: Tensor, tokens: Tensor, temperature: float):
    """[L, k] ``p_T`` of each draft: draft ``j`` at stream ``t`` is scored by the target's
    logits at position ``t + j + 1`` (which predict ``tokens[t+j+2]``). At T=0 it is 1 where
    the draft is the served token (the target's greedy one), else 0.

    logits [L, V] float (target, position i predicts token i+1); drafts [L, k]; tokens [L].
    """
    n, k = drafts.shape
    out = torch.zeros(n, k)
    for j in range(k):
        rows = torch.arange(n - j - 2)  # streams whose draft j has a token to be checked against
        if temperature == 0.0:
            out[rows, j] = (drafts[rows, j] == tokens[rows + j + 2]).float()
        else:
            logp = torch.log_softmax(logits[rows + j + 1].float() / temperature, dim=-1)
            out[rows, j] = logp.gather(1, drafts[rows, j, None]).squeeze(1).exp()
    return out


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
        "replayed_drafts": expected.num_drafts,
        "replayed_accepted_per_pos": expected.accepted_per_pos,
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


class DraftReplica:
    """An EAGLE-3 head and its target in torch (float32, CPU), to recompute the head's drafts
    and the target's logits on served sequences."""

    def __init__(self, head_dir: str, target) -> None:
        from transformers import AutoModelForCausalLM

        from draftsmith.drafters.eagle3.layouts import fit_to_target, read_head

        self.model = AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).eval()
        self.head, facts = read_head(head_dir, target.config)
        fit_to_target(self.head, facts, target)
        embed = facts.embed_tokens
        if embed is None:
            embed = self.model.get_input_embeddings().weight
        self.head.set_embeddings(embed.float())
        self.head.eval()
        self.layer_ids = sorted(set(facts.layer_ids))  # vLLM feeds them in ascending order

    @torch.no_grad()
    def logits_and_drafts(self, tokens: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """tokens [L] -> (target logits [L, V], the head's k-chain drafts [L, k] as target ids)."""
        from draftsmith.drafters.attention.ttt import ttt_unroll

        layers = self.model.model.layers
        captured = {}
        hook = layers[-1].register_forward_hook(
            lambda _m, _i, o: captured.__setitem__("last", o[0] if isinstance(o, tuple) else o)
        )
        try:
            out = self.model(tokens[None], output_hidden_states=True)
        finally:
            hook.remove()
        n = len(layers)  # id n: the last layer's output before the final norm
        states = [captured["last"] if i == n else out.hidden_states[i] for i in self.layer_ids]
        aux = torch.cat(states, dim=-1).float()  # [1, L, n_aux * H]
        positions = torch.arange(tokens.numel())[None]
        steps = ttt_unroll(self.head, tokens[None], aux, positions, torch.zeros_like(positions), k,
                           window=self.head.sliding_window)  # fmt: skip
        drafts = [
            self.head.draft_to_target((s[0] @ self.head.logits_weight.T).argmax(-1)) for s in steps
        ]
        return out.logits[0].float(), torch.stack(drafts, dim=1)

    def expected(
        self, prompts: list[list[int]], replies: list[list[int]], temperature: float, k: int
    ) -> Expected:
        """The replay of every (prompt, reply) at ``temperature``, summed."""
        total = Expected(accepted_per_pos=[0] * k, expected_per_pos=[0.0] * k)
        for prompt, reply in zip(prompts, replies, strict=True):
            tokens = torch.tensor(list(prompt) + list(reply))
            logits, drafts = self.logits_and_drafts(tokens, k)
            p = draft_probabilities(logits, drafts, tokens, temperature)
            total.add(replay(tokens, drafts, p, len(prompt) - 1))
        return total
