"""Shard writer and memory-mapped dataset reader: round trips, atomicity, errors."""

from __future__ import annotations

import errno
import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.utils.data import DataLoader

from draftsmith.core import files
from draftsmith.core.errors import DiskFullError
from draftsmith.core.files import sha256_file, write_json_atomic
from draftsmith.dataset.reader import DatasetError, open_dataset
from draftsmith.dataset.shards import (
    STORAGE_DTYPES,
    ShardInfo,
    bytes_per_token,
    decode_hidden,
    encode_hidden,
    write_shard,
)

LAYER_IDS = [1, 3, 5]
HIDDEN = 16


def make_samples(n: int, seed: int, prefix: str = "s") -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for k in range(n):
        t = int(torch.randint(1, 12, (1,), generator=g))
        h = torch.randn(t, len(LAYER_IDS), HIDDEN, generator=g) * (k + 1)
        h[0, 0] = 0.0  # an all-zero token-layer row: fp8 scaling must not divide by zero
        samples.append(
            {
                "id": f"{prefix}{k}",
                "input_ids": torch.randint(0, 50_000, (t,), generator=g),
                "loss_mask": torch.rand(t, generator=g) > 0.5,
                "hidden_states": h,
            }
        )
    return samples


def write_dataset(
    root: Path, shards: list[list[dict]], storage_dtype: str, complete: bool = True
) -> dict:
    """A minimal manifest with the fields the reader relies on."""
    root.mkdir(parents=True, exist_ok=True)
    infos = [
        write_shard(root / f"shard-{k:05d}.safetensors", samples, storage_dtype).to_dict()
        for k, samples in enumerate(shards)
    ]
    manifest = {
        "format": "draftsmith.hidden_states",
        "format_version": 1,
        "storage_dtype": storage_dtype,
        "layer_ids": LAYER_IDS,
        "hidden_size": HIDDEN,
        "shards": infos,
        "num_shards_planned": len(shards),
        "complete": complete,
    }
    write_json_atomic(root / "manifest.json", manifest)
    return manifest


def assert_close_for(storage_dtype: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if storage_dtype == "float32":
        assert torch.equal(got, want)
    elif storage_dtype in ("bfloat16", "float16"):
        torch.testing.assert_close(got, want.to(getattr(torch, storage_dtype)).float())
        tol = {"bfloat16": 2**-8, "float16": 2**-11}[storage_dtype]
        assert ((got - want).abs() <= tol * want.abs() + 1e-6).all()
    else:
        row_max = want.abs().amax(dim=-1, keepdim=True)
        assert ((got - want).abs() <= 0.07 * row_max).all()
        assert (got[row_max.squeeze(-1) == 0] == 0).all()


@pytest.mark.parametrize("storage_dtype", STORAGE_DTYPES)
def test_round_trip_random_access(tmp_path, storage_dtype):
    shards = [make_samples(4, seed=1, prefix="a"), make_samples(3, seed=2, prefix="b")]
    write_dataset(tmp_path, shards, storage_dtype)
    ds = open_dataset(tmp_path)
    flat = [s for shard in shards for s in shard]
    assert len(ds) == len(flat)
    assert ds.lengths == [s["input_ids"].numel() for s in flat]
    assert (ds.layer_ids, ds.num_layers, ds.hidden_size) == (LAYER_IDS, 3, HIDDEN)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
    for i in order + [-1]:
        got, want = ds[i], flat[i]
        assert got["id"] == want["id"]
        assert got["input_ids"].dtype == torch.long
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert got["loss_mask"].dtype == torch.bool
        assert torch.equal(got["loss_mask"], want["loss_mask"])
        assert got["hidden_states"].dtype == torch.float32
        assert got["hidden_states"].shape == want["hidden_states"].shape
        assert_close_for(storage_dtype, got["hidden_states"], want["hidden_states"])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_shard_is_plain_safetensors_with_exact_offsets(tmp_path):
    samples = make_samples(3, seed=3)
    info = write_shard(tmp_path / "shard-00000.safetensors", samples, "fp8_e4m3")
    lengths = [s["input_ids"].numel() for s in samples]
    with safe_open(tmp_path / info.file, framework="pt") as f:
        meta = f.metadata()
        assert meta["format"] == "draftsmith.hidden_states"
        assert meta["storage_dtype"] == "fp8_e4m3"
        assert json.loads(meta["sample_ids"]) == ["s0", "s1", "s2"]
        offsets = f.get_tensor("sample_offsets")
        assert offsets.dtype == torch.int64
        assert offsets.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
        assert f.get_tensor("hidden_states").dtype == torch.float8_e4m3fn
        assert f.get_tensor("hidden_scales").shape == (sum(lengths), len(LAYER_IDS))
        assert torch.equal(
            f.get_tensor("input_ids"), torch.cat([s["input_ids"] for s in samples]).int()
        )
    assert info.tokens == sum(lengths)
    assert info.loss_tokens == sum(int(s["loss_mask"].sum()) for s in samples)
    assert info.bytes == (tmp_path / info.file).stat().st_size
    assert info.sha256 == sha256_file(tmp_path / info.file)
    assert ShardInfo.from_dict(info.to_dict()) == info


def test_reader_returns_requested_dtype_and_private_tensors(tmp_path):
    samples = make_samples(2, seed=4)
    write_dataset(tmp_path, [samples], "bfloat16")
    ds = open_dataset(tmp_path, dtype=torch.bfloat16)
    first = ds[0]["hidden_states"]
    assert first.dtype == torch.bfloat16
    assert torch.equal(first, samples[0]["hidden_states"].bfloat16())
    first.fill_(7)  # a writable copy: mutating it must not change what is read next
    assert torch.equal(ds[0]["hidden_states"], samples[0]["hidden_states"].bfloat16())


def test_encode_decode_fp8_scales():
    h = torch.randn(5, 2, 32) * torch.tensor([1e-3, 1e3]).view(1, 2, 1)
    h[1, 0] = 0
    enc = encode_hidden(h, "fp8_e4m3")
    assert enc["hidden_states"].dtype == torch.float8_e4m3fn
    assert enc["hidden_scales"].shape == (5, 2)
    assert torch.isfinite(enc["hidden_scales"]).all() and (enc["hidden_scales"] > 0).all()
    out = decode_hidden(enc["hidden_states"], enc["hidden_scales"])
    assert_close_for("fp8_e4m3", out, h)
    with pytest.raises(ValueError, match="hidden_scales"):
        decode_hidden(enc["hidden_states"], None)


def test_bytes_per_token_matches_disk(tmp_path):
    n_layers, hidden, tokens = 3, 64, 200
    sample = {
        "id": "x",
        "input_ids": torch.arange(tokens),
        "loss_mask": torch.ones(tokens, dtype=torch.bool),
        "hidden_states": torch.randn(tokens, n_layers, hidden),
    }
    per = {}
    for storage_dtype in STORAGE_DTYPES:
        info = write_shard(tmp_path / f"{storage_dtype}.safetensors", [sample], storage_dtype)
        expected = bytes_per_token(n_layers, hidden, storage_dtype)
        overhead = info.bytes - expected * tokens
        assert 0 < overhead < 512 + 8 * 2, (storage_dtype, overhead)  # header + offsets
        per[storage_dtype] = expected
    assert per["float32"] == n_layers * hidden * 4 + 5
    assert per["bfloat16"] == n_layers * hidden * 2 + 5
    assert 0.45 < per["fp8_e4m3"] / per["bfloat16"] < 0.6


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    path = tmp_path / "shard-00000.safetensors"

    class FullDisk:
        """A file that accepts a few writes, then runs out of space."""

        def __init__(self, f):
            self.f, self.calls = f, 0

        def write(self, data):
            self.calls += 1
            if self.calls > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    real_open = open
    monkeypatch.setattr(files, "open", lambda p, mode: FullDisk(real_open(p, mode)), raising=False)
    with pytest.raises(DiskFullError, match="shard-00000.safetensors") as err:
        write_shard(path, make_samples(3, seed=5), "bfloat16")
    assert "No space left on device" in str(err.value) and "GiB free" in str(err.value)
    assert isinstance(err.value.__cause__, OSError) and err.value.__cause__.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_write_shard_validates_shapes(tmp_path):
    good = make_samples(2, seed=6)
    bad_layers = [
        good[0],
        {**good[1], "hidden_states": torch.randn(good[1]["input_ids"].numel(), 2, HIDDEN)},
    ]
    with pytest.raises(ValueError, match="differ from earlier"):
        write_shard(tmp_path / "a.safetensors", bad_layers, "float32")
    bad_len = [{**good[0], "loss_mask": torch.ones(99, dtype=torch.bool)}]
    with pytest.raises(ValueError, match="loss_mask shape"):
        write_shard(tmp_path / "b.safetensors", bad_len, "float32")
    with pytest.raises(ValueError, match="storage dtype"):
        write_shard(tmp_path / "c.safetensors", good, "int8")
    assert list(tmp_path.iterdir()) == []


def test_checksum_mismatch_detected(tmp_path):
    manifest = write_dataset(tmp_path, [make_samples(3, seed=7)], "float16")
    shard = tmp_path / manifest["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(data))
    assert len(open_dataset(tmp_path)) == 3  # size-only check passes without hashing
    with pytest.raises(DatasetError, match="sha256"):
        open_dataset(tmp_path, verify_checksums=True)


def test_dataloader_workers_match_direct_indexing(tmp_path):
    write_dataset(
        tmp_path, [make_samples(5, seed=8), make_samples(4, seed=9, prefix="t")], "fp8_e4m3"
    )
    ds = open_dataset(tmp_path)
    ds[0]  # maps opened in the parent must neither be pickled nor shared with workers
    clone = pickle.loads(pickle.dumps(ds))  # what a spawn-started worker receives
    assert torch.equal(clone[0]["hidden_states"], ds[0]["hidden_states"])
    loader = DataLoader(ds, batch_size=None, shuffle=True, num_workers=2)
    got = sorted(loader, key=lambda s: ds.ids.index(s["id"]))
    assert [s["id"] for s in got] == ds.ids
    for i, sample in enumerate(got):
        assert torch.equal(sample["hidden_states"], ds[i]["hidden_states"])
        assert torch.equal(sample["input_ids"], ds[i]["input_ids"])


def test_incomplete_and_missing_errors(tmp_path):
    with pytest.raises(DatasetError, match="no manifest.json; run `draftsmith extract`"):
        tmp_path.joinpath("empty").mkdir()
        open_dataset(tmp_path / "empty")
    with pytest.raises(DatasetError, match="not a draftsmith dataset"):
        open_dataset(tmp_path / "nowhere")

    root = tmp_path / "ds"
    manifest = write_dataset(root, [make_samples(2, seed=10)], "bfloat16", complete=False)
    with pytest.raises(DatasetError, match="unfinished.*re-running the same"):
        open_dataset(root)
    assert len(open_dataset(root, allow_incomplete=True)) == 2

    write_json_atomic(root / "manifest.json", {**manifest, "format_version": 99})
    with pytest.raises(DatasetError, match="format_version 99"):
        open_dataset(root, allow_incomplete=True)

    (root / manifest["shards"][0]["file"]).unlink()
    write_json_atomic(root / "manifest.json", manifest)
    with pytest.raises(DatasetError, match="file is missing"):
        open_dataset(root, allow_incomplete=True)


def test_empty_shard_is_skipped(tmp_path):
    write_dataset(tmp_path, [[], make_samples(2, seed=11)], "fp8_e4m3")
    ds = open_dataset(tmp_path)
    assert ds.ids == ["s0", "s1"]
    assert ds[1]["hidden_states"].shape[1:] == (len(LAYER_IDS), HIDDEN)
