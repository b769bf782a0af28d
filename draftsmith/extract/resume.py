"""Resume and repair: what a run finds in its output, and which shards it passes again.

Every file of a dataset is written whole (``core/files.write_atomic``) and a shard counts
as done once its sidecar agrees with the plan (``manifest.shard_done``). So the same
command run again, after a crash, SIGTERM, a full disk or a time limit, passes only the
shards of its worker that are not done (``Output.todo``), and a run that finds the dataset
complete starts no engine (``Output.complete``). ``--repair true`` deletes the shards whose
bytes differ from their recorded sha256 (``Output.repair``): the pass writes exactly those
again, with the settings the dataset was made with (:func:`settings_to_repair`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from draftsmith.core.console import say
from draftsmith.core.errors import ConfigError
from draftsmith.core.targets import TargetInfo
from draftsmith.dataset import manifest
from draftsmith.extract.config import ExtractConfig
from draftsmith.extract.records import Schedule

# A dataset's manifest is rebuilt from its plan and sidecars: a damaged one can go.
REBUILD = "delete it and re-run the same command, which writes it again from the sidecars"


@dataclasses.dataclass(frozen=True)
class Output:
    """The dataset directory a run writes, and what its manifest records beside the shards
    (the target, the layer ids and the settings)."""

    path: Path
    target: TargetInfo
    layer_ids: list[int]
    config: dict
    fingerprint: dict
    """What its content depends on (``plan.json`` keeps it: ``sample_plan.fingerprint``)."""

    def manifest(self, stopped_by: str | None = None) -> dict:
        """The manifest rebuilt from the plan and the sidecars on disk (and written)."""
        return manifest.build_manifest(
            self.path, self.target, self.layer_ids, self.config, stopped_by
        )

    def complete(self) -> bool:
        """Whether the manifest there says every planned shard is written."""
        found = self.path / "manifest.json"
        return found.is_file() and bool(manifest.read_manifest(found, REBUILD).get("complete"))

    def repair(self, schedule: Schedule) -> list[int]:
        """Delete this worker's shards (``k % workers == worker``) whose sha256 differs from
        their record, sidecars too, and rebuild the manifest without them; returns them,
        the shards to pass again."""
        planned = len(manifest.read_plan(self.path)["shards"])
        mine = [k for k in range(planned) if k % schedule.workers == schedule.worker]
        bad = manifest.repair_shards(self.path, mine)
        say(f"extract: repair: {len(bad)} of {len(mine)} shards failed their sha256"
            + (f" ({', '.join(manifest.shard_name(k) for k in bad)}); extracting them again"
               if bad else ""))  # fmt: skip
        if bad:
            self.manifest()
        return bad

    def todo(
        self, shards: list[list[str]], schedule: Schedule, repaired: list[int] | None
    ) -> list[int]:
        """The shards this worker passes: its planned ones not done yet, in plan order; when
        repairing, exactly those `repaired` deleted, nothing planned beyond."""
        mine = [
            k
            for k in range(len(shards))
            if k % schedule.workers == schedule.worker
            and not manifest.shard_done(self.path, k, shards[k])
        ]
        return mine if repaired is None else [k for k in mine if k in repaired]


def settings_to_repair(cfg: ExtractConfig) -> ExtractConfig:
    """``--repair true`` on a dataset: the settings it was extracted with, read from its
    ``manifest.json``, so that the shards written again are the ones planned; only
    ``output``, ``workers`` and ``worker`` come from the command line."""
    from draftsmith.core.config import parse_section

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
