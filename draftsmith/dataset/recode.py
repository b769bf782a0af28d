"""Write a dataset again in another storage dtype (or with fewer tapped layers).

    python -m draftsmith.dataset.recode --src outputs/acc/demo-f32 --dst outputs/acc/demo-fp8 \\
        --dtype fp8_e4m3
    python -m draftsmith.dataset.recode --src DIR --dst DIR-last --layer_ids '[30]'  # EAGLE-1

Each sample is decoded to float32 and written again as ``draftsmith extract`` writes it
(``shards.write_shard``: the same encode, per-sample checksums), shard for shard, with the
same sample ids and plan, so two recodings of one float32 extraction differ only in how the
states are stored: what the fp8-against-bf16 comparison needs (one engine pass, no chance
of the target answering the prompts differently twice). Recoding an already rounded dataset
(bf16 to fp8) rounds twice; from float32 it is exactly the extraction's own encode.
``layer_ids`` keeps a subset of the tapped layers (what a kind reads: EAGLE-1 and MTP only
the last one), the bytes of the others dropped.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from draftsmith.core.config import parse_config
from draftsmith.core.errors import ConfigError, exit_code
from draftsmith.core.files import write_json_atomic
from draftsmith.dataset.manifest import PLAN_FILE, sidecar_path
from draftsmith.dataset.reader import open_dataset
from draftsmith.dataset.shards import bytes_per_token, write_shard


@dataclass
class RecodeConfig:
    """Write a draftsmith dataset again in another storage dtype or with fewer layers."""

    src: str
    """The dataset to read (a finished ``draftsmith extract`` output)."""
    dst: str
    """Where to write the recoded dataset (must not exist)."""
    dtype: Literal["bfloat16", "float16", "float32", "fp8_e4m3"] | None = None
    """Storage dtype of the copy; null: the source's."""
    layer_ids: list[int] | None = None
    """Tapped layers to keep (a subset of the source's); null: all."""


def recode(cfg: RecodeConfig) -> dict:
    src, dst = Path(cfg.src), Path(cfg.dst)
    if dst.exists():
        raise ConfigError(f"dst: {dst} exists; give a new directory (recode never overwrites)")
    ds = open_dataset(src, torch.float32, verify_checksums=True)
    manifest = dict(ds.manifest)
    dtype = cfg.dtype or manifest["storage_dtype"]
    keep = list(range(ds.num_layers))
    if cfg.layer_ids is not None:
        missing = [i for i in cfg.layer_ids if i not in ds.layer_ids]
        if missing or not cfg.layer_ids:
            raise ConfigError(
                f"layer_ids: {cfg.layer_ids}; give a non-empty subset of the source's "
                f"{ds.layer_ids} (missing: {missing})"
            )
        keep = [ds.layer_ids.index(i) for i in sorted(set(cfg.layer_ids))]
    dst.mkdir(parents=True)
    if (src / PLAN_FILE).is_file():
        shutil.copy(src / PLAN_FILE, dst / PLAN_FILE)
    shards, first = [], 0
    for info in manifest["shards"]:
        n = len(info["sample_ids"])
        samples = []
        for i in range(first, first + n):
            sample = ds[i]
            samples.append({**sample, "hidden_states": sample["hidden_states"][:, keep]})
        first += n
        written = write_shard(dst / info["file"], samples, dtype).to_dict()
        entry = {**info, **written}
        index = int(Path(info["file"]).stem.split("-")[1])
        write_json_atomic(sidecar_path(dst, index), {**entry, "skipped": []})
        shards.append(entry)
    layer_ids = [ds.layer_ids[k] for k in keep]
    manifest.update(
        storage_dtype=dtype,
        layer_ids=layer_ids,
        bytes_per_token=bytes_per_token(len(layer_ids), ds.hidden_size, dtype),
        shards=shards,
        config={**manifest.get("config", {}), "dtype": dtype, "recoded_from": str(src)},
    )
    write_json_atomic(dst / "manifest.json", manifest)
    return manifest


def main(args: list[str] | None = None) -> int:
    def go() -> int:
        cfg = parse_config(RecodeConfig, args, prog="python -m draftsmith.dataset.recode")
        m = recode(cfg)
        size = sum(s["bytes"] for s in m["shards"])
        print(f"recode: {cfg.dst}: {m['num_samples']} samples, {m['num_tokens']:,} tokens, "
              f"{m['storage_dtype']}, layers {m['layer_ids']}, {size / 1e6:,.1f} MB "
              f"({size / max(m['num_tokens'], 1):,.0f} bytes/token)")  # fmt: skip
        return 0

    return exit_code("recode", go)


if __name__ == "__main__":
    sys.exit(main())
