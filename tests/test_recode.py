"""Recoding a dataset: the extraction's own encode, and the layers a kind reads."""

from __future__ import annotations

import torch

from draftsmith.dataset.reader import open_dataset
from draftsmith.dataset.recode import RecodeConfig, recode
from draftsmith.dataset.shards import write_shard
from draftsmith.train.data import StatesDataModule
from tests.test_train_data import NUM_LAYERS, SHARDED, make_samples, write_dataset


def test_recoding_float32_writes_what_extraction_writes_in_that_dtype(tmp_path):
    """fp8 from a float32 dataset is byte for byte the shard extraction writes from the
    same states with ``dtype: fp8_e4m3`` (so the fp8-vs-bf16 comparison differs in storage
    only), and the copy reads back within fp8's rounding."""
    write_dataset(tmp_path / "f32", SHARDED[:2])
    m = recode(RecodeConfig(src=str(tmp_path / "f32"), dst=str(tmp_path / "fp8"),
                            dtype="fp8_e4m3"))  # fmt: skip
    assert m["storage_dtype"] == "fp8_e4m3" and m["bytes_per_token"] == 4 * 16 + 5 + 16
    direct = write_shard(tmp_path / "direct.safetensors", make_samples(SHARDED[0], 0, [2, 4, 5, 8]),
                         "fp8_e4m3")  # fmt: skip
    assert m["shards"][0]["sha256"] == direct.sha256
    assert m["shards"][0]["sample_xxh3"] == direct.sample_xxh3
    src, fp8 = open_dataset(tmp_path / "f32"), open_dataset(tmp_path / "fp8")
    for i in range(len(src)):
        a, b = src[i]["hidden_states"], fp8[i]["hidden_states"]
        assert torch.allclose(a, b, rtol=0.07, atol=0) and src[i]["id"] == fp8[i]["id"]


def test_storing_only_the_last_layer_trains_eagle1_on_the_same_batches(tmp_path):
    """EAGLE-1 reads layer N alone: a dataset of that one layer (a quarter of the bytes)
    gives the drafters exactly the batches of the four-layer one."""
    write_dataset(tmp_path / "all", SHARDED)
    recode(RecodeConfig(src=str(tmp_path / "all"), dst=str(tmp_path / "last"),
                        layer_ids=[NUM_LAYERS]))  # fmt: skip
    kw = dict(row_tokens=9, batch_size=2, val_fraction=0.2, seed=3, num_workers=0,
              aux_layers=[NUM_LAYERS])  # fmt: skip
    for order in ("samples", "shards"):
        full = StatesDataModule(str(tmp_path / "all"), order=order, **kw)
        last = StatesDataModule(str(tmp_path / "last"), order=order, **kw)
        assert last.manifest["layer_ids"] == [NUM_LAYERS]
        assert last.manifest["bytes_per_token"] == 1 * 16 * 4 + 5  # [N] alone, float32
        a = [full.model_batch(b) for b in full.train_dataloader()]
        b = [last.model_batch(b) for b in last.train_dataloader()]
        assert len(a) == len(b) > 3
        for x, y in zip(a, b, strict=True):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_byte_planes_give_back_every_bf16_bit(tmp_path):
    """The byte-plane split that bench.planes compresses is lossless: every bit pattern of
    bf16 (NaNs, infinities, signed zeros, subnormals) comes back, so a head trained on the
    decompressed states would see exactly the bf16 values; and the planes are the high and
    low bytes (the high one, sign and exponent, is the one with few distinct values)."""
    from draftsmith.bench.planes import from_planes, planes

    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    hi, lo = planes(every.reshape(256, 256))
    assert len(hi) == len(lo) == 2**16
    back = from_planes(hi, lo, (256, 256))
    assert torch.equal(back.reshape(-1).view(torch.int16), every.view(torch.int16))
    states = torch.randn(64, 4, 32).to(torch.bfloat16)
    hi, lo = planes(states)
    assert len(set(hi)) < len(set(lo))  # exponents cluster; mantissa bytes do not
    sign_exp = (states.view(torch.int16).reshape(-1) >> 8) & 0xFF
    assert list(hi) == sign_exp.tolist()
