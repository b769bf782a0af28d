"""``draftsmith extract``: conversations -> target's template -> vLLM hidden states -> shards.

    draftsmith extract --config configs/extract/smollm2.yaml [--output DIR] [--verify 4]

Re-running the same command resumes: finished shards are kept, the rest are redone.
Several workers (``--workers W --worker i``) can fill one directory in parallel.
SIGTERM keeps the shards finished, shuts vLLM down and exits 143 in one line; a full disk
ends in one line naming the path and the free space (exit 2); either way the same command
run again goes on.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from draftsmith.conversations.sources import SkipLog
from draftsmith.conversations.template import reasoning_ends
from draftsmith.core.config import parse_config, to_dict
from draftsmith.core.console import progress, say, stage_log
from draftsmith.core.engine import check_engine_options, check_temperature
from draftsmith.core.errors import ConfigError, exit_code
from draftsmith.core.outputs import EXTRACT_OWN, check_output
from draftsmith.core.signals import Terminated, sigterm_raises
from draftsmith.core.targets import (
    TargetError,
    default_layer_ids,
    load_tokenizer,
    read_target,
    validate_layer_ids,
)
from draftsmith.dataset.manifest import PLAN_FILE
from draftsmith.extract import inputs, sample_plan
from draftsmith.extract.config import ExtractConfig
from draftsmith.extract.engines import LazyEngine, close_started, staging_dir
from draftsmith.extract.interrupted import report_sigterm
from draftsmith.extract.records import Chat, DataOptions, Schedule
from draftsmith.extract.resume import Output, settings_to_repair


def check_config(cfg: ExtractConfig) -> None:
    if cfg.workers < 1 or not 0 <= cfg.worker < cfg.workers:
        raise ConfigError(
            f"worker: {cfg.worker} is not in [0, workers={cfg.workers}); "
            "give each of W workers an index 0..W-1."
        )
    if cfg.samples_per_shard < 1:
        raise ConfigError(f"samples_per_shard: {cfg.samples_per_shard}; give a positive number.")
    for name in ("limit", "max_new_tokens", "verify", "time_limit", "verify_tolerance"):
        value = getattr(cfg, name)
        low = 1 if name in ("limit", "max_new_tokens") else 0
        if value is not None and value < low:
            raise ConfigError(
                f"{name}: {value} is out of range; give a number >= {low}"
                + (" (or null for no limit)." if name in ("limit", "time_limit") else ".")
            )
    if cfg.kind is not None:
        from draftsmith import drafters

        if cfg.kind not in drafters.names():
            raise ConfigError(f"kind: {cfg.kind!r} is not a drafter kind; use one of "
                              f"{drafters.names()} or null")  # fmt: skip
    if cfg.max_length < 2:
        raise ConfigError(f"max_length: {cfg.max_length}; give at least 2.")
    check_temperature("temperature", cfg.temperature)
    check_engine_options(cfg.engine)
    if cfg.seed < 0:
        raise ConfigError(f"seed: {cfg.seed} is out of range; give a number >= 0")
    if not 0.0 <= cfg.keep_replies <= 1.0:
        raise ConfigError(f"keep_replies: {cfg.keep_replies} is a share; give a number in [0, 1].")
    if cfg.stream and (cfg.repair or cfg.verify):
        raise ConfigError(
            "stream: a producer writes what its trainer asks for until the trainer ends; "
            "drop repair and verify from a streaming run."
        )
    if cfg.stream and cfg.regenerate and cfg.temperature > 0:
        raise ConfigError(
            f"stream: sampled replies (temperature {cfg.temperature}) are written by a "
            "second engine before capture, which a producer does not run yet; stream with "
            "temperature 0, or extract offline."
        )
    if cfg.trainer_timeout <= 0:
        raise ConfigError(f"trainer_timeout: {cfg.trainer_timeout}; give seconds > 0.")
    if cfg.keep_replies and not cfg.regenerate:
        raise ConfigError(
            f"keep_replies: {cfg.keep_replies} mixes kept and regenerated replies; set "
            "regenerate: true (without it every reply is kept already)."
        )


def run(cfg: ExtractConfig) -> dict:
    """Extract (or resume) the dataset described by `cfg`; return its manifest. A streaming
    producer beats from its start (prompts and planning can outlast the trainer's wait).
    However it ends (an error, SIGTERM), the vLLM engines it started are shut down."""
    try:
        if not cfg.stream:
            return _run(cfg, None)
        from draftsmith.dataset.stream import StreamDir
        from draftsmith.extract.producer import Pulse

        with Pulse(StreamDir(cfg.output), cfg.worker) as pulse:
            return _run(cfg, pulse)
    finally:
        close_started()


def _run(cfg: ExtractConfig, pulse) -> dict:
    """Resolve `cfg` against its target and into the records the steps read, see what the
    output holds already, plan the data, then run the pass (``shard_pass.py``) over the
    shards a driver picks: the offline loop, or the streamed producer when `pulse` beats."""
    from draftsmith.extract.shard_pass import ShardPass

    run_started = time.monotonic()
    cfg, out = resolve(cfg)
    schedule = Schedule(cfg.worker, cfg.workers, cfg.time_limit, cfg.trainer_timeout)
    repaired = [] if cfg.repair else None  # when repairing: the shards to pass again
    if cfg.repair and (out.path / PLAN_FILE).is_file():
        repaired = out.repair(schedule)
    elif not cfg.stream and out.complete():
        return out.manifest()

    opts = DataOptions(
        data=cfg.data,
        bad_rows=cfg.bad_rows,
        encoding=cfg.encoding,
        regenerate=cfg.regenerate,
        seed=cfg.seed,
        keep_replies=cfg.keep_replies,
        keep_reasoning=cfg.keep_reasoning,
        chat_template_kwargs=cfg.chat_template_kwargs,
        max_length=cfg.max_length,
        overlong=cfg.overlong,
        limit=cfg.limit,
        samples_per_shard=cfg.samples_per_shard,
    )
    tokenizer = load_tokenizer(out.target.path)
    max_len = cfg.max_length + 1  # the engine needs one position past the longest sequence
    # Sampling happens in a plain engine: vLLM 0.32's capture method corrupts sampled text.
    writer = LazyEngine(out.target.path, cfg.engine, max_len)
    skips = SkipLog()
    convs = inputs.conversations(opts, tokenizer, writer, out.path, skips, pulse)
    if pulse is not None:
        pulse.set(state="planning shards")
    plan = sample_plan.plan_dataset(convs, tokenizer, opts, skips, out.path, out.fingerprint)

    chat = Chat(
        tokenizer=tokenizer,
        template_kwargs=cfg.chat_template_kwargs,
        max_length=cfg.max_length,
        overlong=cfg.overlong,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        reasoning_ends=reasoning_ends(tokenizer),
    )
    staging = staging_dir(out.path, cfg.worker, cfg.staging_dir)
    job = ShardPass(
        cfg=schedule,
        engine=LazyEngine(out.target.path, cfg.engine, max_len, out.layer_ids, staging),
        plan=plan,
        chat=chat,
        mask_ends=None if cfg.keep_reasoning else chat.reasoning_ends,
        dtype=cfg.dtype,
        regenerate=cfg.regenerate,
        keep_streamed=cfg.stream and cfg.regenerate,
        dataset=out,
    )
    todo = out.todo(plan.shards, schedule, repaired)
    if cfg.regenerate and cfg.temperature > 0:
        job.answer_ahead(writer, todo)
    writer.close()
    if pulse is not None:
        from draftsmith.extract.producer import serve

        return serve(job, pulse)
    return offline(job, todo, run_started)


def resolve(cfg: ExtractConfig) -> tuple[ExtractConfig, Output]:
    """Check `cfg`, read its target (refused where vLLM cannot tap it, or the drafter kind
    cannot train on it), choose its layers, fit ``max_length`` to its positions (the config
    returned), and refuse an output that holds a dataset made with other settings."""
    check_config(cfg)
    target = read_target(cfg.model)
    if refusal := target.eagle3_refusal:
        raise TargetError(
            f"model: {cfg.model!r} cannot be tapped for EAGLE-3: {refusal}; pick a target whose "
            "vLLM model implements SupportsEagle3."
        )
    if cfg.kind is not None:  # before any engine: a kind that cannot use the data says so now
        from draftsmith import drafters

        try:
            drafters.get(cfg.kind).check_target(target, {})
        except ConfigError as err:
            why = str(err).removeprefix(f"model.kind {cfg.kind}: ")
            raise ConfigError(f"kind: {cfg.kind}: {why}") from None
    layer_ids = validate_layer_ids(
        cfg.layer_ids if cfg.layer_ids is not None else default_layer_ids(target.num_hidden_layers),
        target.num_hidden_layers,
    )
    limit = target.max_position_embeddings
    if limit and cfg.max_length + 1 > limit:
        # The engine needs one position past the longest stored sequence.
        say(f"extract: max_length {cfg.max_length} -> {limit - 1} (the target has {limit})")
        cfg = dataclasses.replace(cfg, max_length=limit - 1)
    output = Path(cfg.output)
    fp = sample_plan.fingerprint(cfg, target, layer_ids)
    sample_plan.check_fingerprint(output, fp)
    config = {**to_dict(cfg), "model_path": target.path, "layer_ids": layer_ids}
    return cfg, Output(output, target, layer_ids, config, fp)


def offline(job, todo: list[int], run_started: float) -> dict:
    """The offline driver: the pass (``job``, a ``ShardPass``) over `todo` in order, behind
    a progress bar. With a time limit (counted from `run_started`, engine starts included)
    no shard starts that would end past it, and the manifest says ``stopped_by``."""
    time_limit = job.cfg.time_limit
    if todo:
        verb = "reusing the running" if job.engine.reused else "starting"
        say(f"extract: {verb} vLLM ({job.target.path}, layers {job.layer_ids})")
        if time_limit:
            left = time_limit - (time.monotonic() - run_started)
            say(f"extract: time_limit leaves {left:.0f} s: no shard starts that would end later")
        job.engine.get()  # start it before the clock: shard times measure capture alone
    started, tokens, stopped_by = time.monotonic(), 0, None
    bar = progress(sum(len(job.shards[k]) for k in todo), "extract", unit="sample")
    for n_done, k in enumerate(todo):
        shard_start = time.monotonic()
        per_shard = (shard_start - started) / n_done if n_done else 0.0
        if n_done and time_limit and shard_start + per_shard > run_started + time_limit:
            stopped_by = "time_limit"  # the next shard would end past the limit
            say(f"extract: time_limit {time_limit:.0f} s reached after {n_done} shards")
            break
        tokens += job.extract(k)
        rate = tokens / max(time.monotonic() - started, 1e-9)
        bar.set_postfix(tok_s=f"{rate:,.0f}", shard=k)
        bar.update(len(job.shards[k]))
    bar.close()
    job.engine.close()
    return job.dataset.manifest(stopped_by)


def summary(man: dict) -> str:
    """A few lines for the terminal."""
    sk = man["skipped"]
    top = sorted(sk["by_reason"].items(), key=lambda kv: -kv[1])[:3]
    reasons = ", ".join(f"{n} {why}" for why, n in top) + (
        ", ..." if len(sk["by_reason"]) > 3 else ""
    )
    return (
        f"dataset: {man['num_samples']} samples"
        + (f" ({man['num_turn_samples']} single turns)" if man.get("num_turn_samples") else "")
        + f", {man['num_tokens']:,} tokens ("
        + (
            f"{man['num_unique_tokens']:,} unique, "
            if man.get("num_unique_tokens", man["num_tokens"]) != man["num_tokens"]
            else ""
        )
        + f"{man['num_loss_tokens']:,} in loss) in {len(man['shards'])} of "
        f"{man['num_shards_planned']} shards"
        + (f" (stopped by {man['stopped_by']})" if man.get("stopped_by") else "")
        + f"; layers {man['layer_ids']} as {man['storage_dtype']}; skipped {sk['count']}"
        + (f" ({reasons}; all in manifest.json)" if sk["count"] else "")
        + f", truncated {sk['truncated']}"
    )


def main(args: list[str] | None = None) -> int:
    prog = "draftsmith extract"
    return exit_code(prog, lambda: run_stage(parse_config(ExtractConfig, args, prog=prog)))


def run_stage(cfg: ExtractConfig) -> int:
    if cfg.repair:
        cfg = settings_to_repair(cfg)
    check_config(cfg)
    check_output(cfg.output, "output", EXTRACT_OWN, overwrite=cfg.overwrite)
    try:  # SIGTERM: whole shards kept, one line, exit 143 (extract/interrupted.py)
        with stage_log(Path(cfg.output) / "extract.log") as log, sigterm_raises():
            man = run(cfg)
    except Terminated:
        return report_sigterm("draftsmith extract", cfg.output)
    say(summary(man) + (f"\nlog: {log}" if log else ""))
    if cfg.verify:
        from draftsmith.extract.verify import verify_dataset

        report = verify_dataset(cfg.output, cfg.verify, cfg.verify_tolerance)
        say(report.text())
        if not report.ok:
            return 1
    return 0
