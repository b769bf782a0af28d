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
import hashlib
import time
from pathlib import Path

from draftsmith.conversations.sources import DataError, SkipLog, load_many
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
from draftsmith.extract import replies
from draftsmith.extract.config import ExtractConfig
from draftsmith.extract.engines import LazyEngine, close_started
from draftsmith.extract.interrupted import report_sigterm

# A dataset's manifest is rebuilt from its plan and sidecars: a damaged one can go.
REBUILD = "delete it and re-run the same command, which writes it again from the sidecars"


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


def staging_dir(cfg: ExtractConfig, output: Path) -> Path:
    """Per-output, per-worker scratch space, in memory (/dev/shm) when the system has it."""
    if cfg.staging_dir:
        return Path(cfg.staging_dir) / f"worker-{cfg.worker}"
    tag = hashlib.sha256(str(output.resolve()).encode()).hexdigest()[:12]
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() else output
    return base / f"draftsmith-staging-{tag}-w{cfg.worker}"


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
    from draftsmith.dataset import manifest
    from draftsmith.extract import sample_plan as plan

    run_started = time.monotonic()
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
    fp = plan.fingerprint(cfg, target, layer_ids)
    plan.check_fingerprint(output, fp)
    config = {**to_dict(cfg), "model_path": target.path, "layer_ids": layer_ids}
    existing = output / "manifest.json"
    repaired: list[int] = []
    if cfg.repair and (output / manifest.PLAN_FILE).is_file():
        planned = len(manifest.read_plan(output)["shards"])
        mine = [k for k in range(planned) if k % cfg.workers == cfg.worker]
        bad = repaired = manifest.repair_shards(output, mine)
        say(f"extract: repair: {len(bad)} of {len(mine)} shards failed their sha256"
            + (f" ({', '.join(manifest.shard_name(k) for k in bad)}); extracting them again"
               if bad else ""))  # fmt: skip
        if bad:
            manifest.build_manifest(output, target, layer_ids, config)
    elif (
        not cfg.stream
        and existing.is_file()
        and manifest.read_manifest(existing, REBUILD).get("complete")
    ):
        return manifest.build_manifest(output, target, layer_ids, config)

    tokenizer = load_tokenizer(target.path)
    skips = SkipLog()
    file_specs = [s for s in cfg.data if not s.startswith("self:")]
    self_specs = [s for s in cfg.data if s.startswith("self:")]
    convs = load_many(
        file_specs,
        bad_rows=cfg.bad_rows,
        require_assistant=not cfg.regenerate,
        skips=skips,
        encoding=cfg.encoding,
    )

    # Sampling happens in a plain engine: vLLM 0.32's capture method corrupts sampled text.
    writer = LazyEngine(cfg, target.path)
    if self_specs:
        from draftsmith.conversations.selfwrite import write_prompts

        if not cfg.regenerate:
            raise ConfigError(
                f"data: {self_specs} are prompts without replies; set regenerate: true "
                "so the target answers them."
            )
        count = sum(_self_count(s) for s in self_specs)
        say(f"extract: the target writes {count} prompts (vLLM, pre-query sampling)")
        if pulse is not None:
            pulse.set(state=f"writing {count} prompts")
        convs += write_prompts(writer, tokenizer, count, cfg.seed, output / "prompts.self.jsonl")
    if pulse is not None:
        pulse.set(state="planning shards")
    items = plan.plan_items(convs, tokenizer, cfg, skips)
    if not items:
        raise DataError(f"data: {cfg.data} gave no usable conversation ({skips.by_reason()})")
    shards = plan.shard_ids(items, cfg.samples_per_shard)
    manifest.write_plan(output, fp, shards, skips.to_dict())
    by_id = {sid: it for it in items for sid in it.sample_ids()}  # sample id -> its item

    todo = [
        k
        for k in range(len(shards))
        if k % cfg.workers == cfg.worker and not manifest.shard_done(output, k, shards[k])
    ]
    if cfg.repair:  # exactly the shards that failed their checksum, nothing planned beyond
        todo = [k for k in todo if k in repaired]
    written = {}
    if cfg.regenerate and cfg.temperature > 0:
        written = replies.write_sampled(writer, tokenizer, todo, shards, by_id, cfg, output)
    writer.close()
    engine = LazyEngine(cfg, target.path, layer_ids, staging_dir(cfg, output))
    job = ShardJob(engine, tokenizer, shards, by_id, written, cfg, output, target, layer_ids,
                   config)  # fmt: skip
    if pulse is not None:
        from draftsmith.extract.producer import serve

        return serve(job, pulse)
    if todo:
        verb = "reusing the running" if engine.reused else "starting"
        say(f"extract: {verb} vLLM ({target.path}, layers {layer_ids})")
        if cfg.time_limit:
            left = cfg.time_limit - (time.monotonic() - run_started)
            say(f"extract: time_limit leaves {left:.0f} s: no shard starts that would end later")
        engine.get()  # start it before the clock: shard times measure capture alone
    started, tokens, stopped_by = time.monotonic(), 0, None
    bar = progress(sum(len(shards[k]) for k in todo), "extract", unit="sample")
    for n_done, k in enumerate(todo):
        shard_start = time.monotonic()
        per_shard = (shard_start - started) / n_done if n_done else 0.0
        if n_done and cfg.time_limit and shard_start + per_shard > run_started + cfg.time_limit:
            stopped_by = "time_limit"  # the next shard would end past the limit
            say(f"extract: time_limit {cfg.time_limit:.0f} s reached after {n_done} shards")
            break
        tokens += job.extract(k)
        rate = tokens / max(time.monotonic() - started, 1e-9)
        bar.set_postfix(tok_s=f"{rate:,.0f}", shard=k)
        bar.update(len(shards[k]))
    bar.close()
    engine.close()
    return manifest.build_manifest(output, target, layer_ids, config, stopped_by)


@dataclasses.dataclass
class ShardJob:
    """What extracting one planned shard needs; ``extract(k)`` writes shard k."""

    engine: LazyEngine
    tokenizer: object
    shards: list[list[str]]
    by_id: dict
    written: dict
    cfg: ExtractConfig
    output: Path
    target: object
    layer_ids: list[int]
    config: dict

    def extract(self, k: int) -> int:
        """Capture, write and record shard ``k`` (file, then sidecar, then the manifest);
        returns its tokens."""
        from draftsmith.core.files import write_json_atomic
        from draftsmith.dataset import manifest
        from draftsmith.dataset.shards import write_shard
        from draftsmith.extract import capture
        from draftsmith.extract import sample_plan as plan

        shard_start, output = time.monotonic(), self.output
        sequences, shard_skips = self.written.get(k, (None, SkipLog()))
        kept = replies.path(output, k)  # a streamed shard's greedy replies, once written
        replay = self.cfg.stream and self.cfg.regenerate and sequences is None
        if replay and kept.is_file():
            sequences, shard_skips = replies.load(kept, self.by_id)
        samples = capture.capture_shard(
            self.engine.get(),
            self.tokenizer,
            plan.shard_items(self.shards[k], self.by_id),
            self.cfg,
            shard_skips,
            written=sequences,
        )
        if replay and sequences is None:  # answered in this pass: keep the replies' ids
            rows = [
                replies.row(
                    x["id"],
                    x["input_ids"].tolist(),
                    x["loss_mask"].tolist(),
                    x["turn"],
                    x["shared"],
                )
                for x in samples
                if not self.by_id[x["id"]].input_ids  # kept replies are planned ids already
            ]
            replies.save(kept, rows, shard_skips)
        # generation: the target answered in the capturing pass; prefill: every sequence
        # was final before it (kept replies, sampled ones, or a streamed shard's own)
        captured_by = "generation" if self.cfg.regenerate and sequences is None else "prefill"
        info = write_shard(output / manifest.shard_name(k), samples, self.cfg.dtype)
        write_json_atomic(
            manifest.sidecar_path(output, k),
            {
                **info.to_dict(),
                "sample_tokens": [len(s["input_ids"]) for s in samples],  # packing, unread
                # Per-turn samples repeat their conversation's prefix: what is new in each.
                "turn_samples": sum(s.get("turn") is not None for s in samples),
                "samples_by_turn": _by_turn(samples),
                "unique_tokens": info.tokens - sum(s.get("shared", 0) for s in samples),
                "seconds": round(time.monotonic() - shard_start, 3),
                "captured_by": captured_by,
                "skipped": shard_skips.to_dict()["rows"],
                "truncated": shard_skips.truncated,  # conversations cut to the rounds that fit
            },
        )
        manifest.build_manifest(output, self.target, self.layer_ids, self.config)
        return info.tokens


def _by_turn(samples: list[dict]) -> dict[str, int]:
    """How many per-turn samples hold the k-th assistant turn, by k."""
    counts: dict[str, int] = {}
    for sample in samples:
        if sample.get("turn") is not None:
            counts[str(sample["turn"])] = counts.get(str(sample["turn"]), 0) + 1
    return counts


def _self_count(spec: str) -> int:
    try:
        count = int(spec.split(":", 1)[1])
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError(f"data: {spec!r}; write self:N with N a positive number of prompts.")
    return count


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


def settings_to_repair(cfg: ExtractConfig) -> ExtractConfig:
    """``--repair true`` on a dataset: the settings it was extracted with, read from its
    ``manifest.json``, so that the shards written again are the ones planned; only
    ``output``, ``workers`` and ``worker`` come from the command line."""
    from draftsmith.core.config import parse_section
    from draftsmith.dataset import manifest

    found = Path(cfg.output) / "manifest.json"
    if not found.is_file():
        raise ConfigError(
            f"repair: {cfg.output} has no manifest.json, so nothing to repair; run the "
            "extraction itself (without --repair) to write it"
        )
    stored = manifest.read_manifest(found, REBUILD).get("config")
    if not isinstance(stored, dict):
        raise ConfigError(f"repair: {found} records no extraction settings; re-extract it")
    names = {f.name for f in dataclasses.fields(ExtractConfig)}
    section = {k: v for k, v in stored.items() if k in names}
    section.update(output=cfg.output, repair=True, workers=cfg.workers, worker=cfg.worker)
    return parse_section(ExtractConfig, section, "draftsmith extract")


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
