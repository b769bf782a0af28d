"""``manifest.json``: the one file that describes a dataset directory.

Each finished shard has a sidecar ``shard-NNNNN.json`` written after the shard file
itself; the manifest is rebuilt from the plan and the sidecars, so it is always a
consistent view, whichever worker wrote it last. ``complete`` is true only when every
planned shard is present.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from draftsmith import __version__
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.files import write_json_atomic
from draftsmith.core.readers import check_shape, read_json
from draftsmith.core.targets import TargetInfo
from draftsmith.dataset.shards import bytes_per_token

LAYER_ID_MEANING = (
    "id k is the residual stream after k decoder layers, before any norm: 0 is the "
    "embedding output, num_hidden_layers is the last layer's output before the final norm "
    "(vLLM's eagle_aux_hidden_state_layer_ids). The layer axis is in ascending id order."
)

PLAN_FILE = "plan.json"
RERUN = "re-run the same `draftsmith extract` command to write it again"


def read_manifest(path: Path, fix: str = RERUN, strict: bool = True) -> dict:
    """``manifest.json`` as an object whose ``shards`` is a list of objects naming a file
    (``strict``; else any object: a summary read for what it has)."""
    if not strict:
        return read_json(path, "dataset manifest", fix)
    data = read_json(path, "dataset manifest", fix, keys=("shards",))
    for shard in check_shape(data["shards"], path, "dataset manifest", fix, list):
        check_shape(shard, path, "dataset manifest", fix, dict, ("file", "sha256", "bytes"))
    return data


def read_plan(output: Path, keys: tuple[str, ...] = ("fingerprint", "shards", "skipped")) -> dict:
    """``plan.json`` as an object holding ``keys``; its ``shards`` a list of sample-id lists."""
    path = output / PLAN_FILE
    fix = f"delete {path} and re-run the same `draftsmith extract` command to plan again"
    data = read_json(path, "dataset plan", fix, keys=keys)
    for shard in check_shape(data.get("shards", []), path, "dataset plan", fix, list):
        check_shape(shard, path, "dataset plan", fix, list)
    return data


def read_sidecar(path: Path) -> dict:
    """A shard's sidecar: what the shard holds and its checksum."""
    fix = f"delete {path} and its shard, then {RERUN}"
    keys = ("sample_ids", "bytes", "sha256")
    return read_json(path, "shard sidecar", fix, keys=keys)


class OutputMismatch(DraftsmithError):
    """The output directory holds a dataset made with other settings."""


def write_plan(output: Path, fp: dict, shards: list[list[str]], skipped: dict) -> None:
    """Write ``plan.json``, or check that the one there lists the same samples."""
    plan_file = output / PLAN_FILE
    digest = hashlib.sha256(json.dumps(shards).encode()).hexdigest()
    if plan_file.is_file():
        found = read_plan(output)
        if found.get("samples_sha256") != digest:
            raise OutputMismatch(
                f"output: {output} was planned with other samples (the inputs changed since "
                "the first run); use another --output, or delete it to start over."
            )
        return
    output.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        plan_file,
        {"fingerprint": fp, "samples_sha256": digest, "shards": shards, "skipped": skipped},
    )


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def sidecar_path(output: Path, index: int) -> Path:
    return output / f"shard-{index:05d}.json"


def shard_done(output: Path, index: int, planned: list[str]) -> bool:
    """A shard counts as done when its sidecar and file exist and agree with the plan."""
    sidecar = sidecar_path(output, index)
    if not sidecar.is_file() or not (output / shard_name(index)).is_file():
        return False
    info = read_sidecar(sidecar)
    skipped = {row["id"] for row in info.get("skipped", [])}
    return (
        info["sample_ids"] == [s for s in planned if s not in skipped]
        and (output / shard_name(index)).stat().st_size == info["bytes"]
    )


def repair_shards(output: Path, indices: list[int]) -> list[int]:
    """Delete each shard among ``indices`` whose sha256 differs from its record (the
    sidecar's, or the manifest's where no sidecar was written), sidecar too, so that
    extraction writes it again; returns the indices deleted."""
    from draftsmith.core.files import sha256_file

    listed = output / "manifest.json"
    recorded = {}
    if listed.is_file():
        recorded = {s["file"]: s["sha256"] for s in read_manifest(listed)["shards"]}
    bad = []
    for k in indices:
        sidecar, shard = sidecar_path(output, k), output / shard_name(k)
        if not shard.is_file():
            continue
        expected = (
            read_sidecar(sidecar).get("sha256") if sidecar.is_file() else recorded.get(shard.name)
        )
        if expected is not None and sha256_file(shard) != expected:
            shard.unlink()
            sidecar.unlink(missing_ok=True)
            bad.append(k)
    return bad


def tokenizer_sha256(model_dir: str) -> str | None:
    """Hash of the tokenizer files, so a dataset can be matched to a target's vocabulary."""
    digest = hashlib.sha256()
    found = False
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        path = Path(model_dir) / name
        if path.is_file():
            digest.update(name.encode() + path.read_bytes())
            found = True
    return digest.hexdigest() if found else None


def target_entry(target: TargetInfo) -> dict:
    """The manifest's ``target`` section: what training checks the dataset against."""
    return {
        "path": target.path,
        "architecture": target.architecture,
        "config_sha256": target.config_sha256,
        "num_hidden_layers": target.num_hidden_layers,
        "vocab_size": target.vocab_size,
    }


def _by_turn(shards: list[dict]) -> dict[str, int]:
    """Per-turn samples by turn number (from 1), summed over the shards."""
    counts: dict[str, int] = {}
    for shard in shards:
        for turn, n in shard.get("samples_by_turn", {}).items():
            counts[turn] = counts.get(turn, 0) + n
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))


def build_manifest(
    output: Path,
    target: TargetInfo,
    layer_ids: list[int],
    config: dict,
    stopped_by: str | None = None,
) -> dict:
    """Assemble the manifest from ``plan.json`` and the shard sidecars; write it atomically.

    ``stopped_by`` (e.g. ``"time_limit"``) marks a run that ended on purpose before every
    planned shard: its whole shards form a dataset that training reads."""
    plan = read_plan(output)
    shards, skipped_rows = [], list(plan["skipped"]["rows"])
    skipped_count, truncated = plan["skipped"]["count"], plan["skipped"].get("truncated", 0)
    for index in range(len(plan["shards"])):
        sidecar = sidecar_path(output, index)
        if sidecar.is_file():
            info = read_sidecar(sidecar)
            skipped_rows += info.get("skipped", [])
            skipped_count += len(info.get("skipped", []))
            truncated += info.get("truncated", 0)
            shards.append({k: v for k, v in info.items() if k not in ("skipped", "truncated")})
    by_reason: dict[str, int] = dict(plan["skipped"]["by_reason"])
    for row in skipped_rows[len(plan["skipped"]["rows"]) :]:
        by_reason[row["reason"]] = by_reason.get(row["reason"], 0) + 1
    num_layers, dtype = len(layer_ids), config["dtype"]
    manifest = {
        "format": "draftsmith.hidden_states",
        "format_version": 1,
        "draftsmith_version": __version__,
        "complete": len(shards) == len(plan["shards"]),
        "stopped_by": None if len(shards) == len(plan["shards"]) else stopped_by,
        "target": target_entry(target),
        "tokenizer": {"path": target.path, "sha256": tokenizer_sha256(target.path)},
        "layer_ids": list(layer_ids),
        "layer_id_meaning": LAYER_ID_MEANING,
        "hidden_size": target.hidden_size,
        "storage_dtype": dtype,
        "bytes_per_token": bytes_per_token(num_layers, target.hidden_size, dtype),
        "loss_mask_meaning": "1 where the token belongs to an assistant turn (a token to predict)",
        "num_shards_planned": len(plan["shards"]),
        "num_samples": sum(s["samples"] for s in shards),
        "num_tokens": sum(s["tokens"] for s in shards),
        "num_loss_tokens": sum(s["loss_tokens"] for s in shards),
        # A template that renders earlier turns differently (reasoning, harmony) gives one
        # sample per assistant turn, each repeating its conversation's prefix.
        "num_turn_samples": sum(s.get("turn_samples", 0) for s in shards),
        "turn_samples_by_turn": _by_turn(shards),
        "num_unique_tokens": sum(s.get("unique_tokens", s["tokens"]) for s in shards),
        "samples_meaning": (
            "a sample is a whole conversation, or (sample id '<conversation>#<k>') the k-th "
            "assistant turn alone after exactly the prompt the target reads when it writes "
            "it; num_unique_tokens counts tokens that are not a repeat of the previous "
            "turn sample's prefix"
        ),
        "shards": shards,
        "skipped": {
            "count": skipped_count,
            "by_reason": by_reason,
            "truncated": truncated,
            "rows": skipped_rows[:1000],
        },
        "config": config,
    }
    write_json_atomic(output / "manifest.json", manifest)
    return manifest
