"""Stored batches: decoded on the device into exactly the old batches; the side-stream copy."""

from __future__ import annotations

import pytest
import torch

from draftsmith.dataset.reader import open_dataset
from draftsmith.train.batches import SideStreamCopy, model_batch
from draftsmith.train.data import StatesDataModule
from draftsmith.train.packing import PackedDataset, pack
from tests.test_train_data import HIDDEN, LAYER_IDS, make_samples

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def stored_dataset(root, storage: str):
    from draftsmith.core.files import write_json_atomic
    from draftsmith.dataset.shards import write_shard
    from tests.test_train_data import TARGET, VOCAB

    root.mkdir()
    samples = make_samples([5, 3, 7, 2, 4, 6], seed=1, layer_ids=LAYER_IDS)
    for s in samples:  # real-valued states: rounding to the storage dtype matters
        s["hidden_states"] = s["hidden_states"] / 7.3
    info = write_shard(root / "shard-00000.safetensors", samples, storage)
    write_json_atomic(root / "manifest.json", {
        "format": "draftsmith.hidden_states", "format_version": 1, "complete": True,
        "target": {**TARGET, "architecture": "LlamaForCausalLM", "vocab_size": VOCAB},
        "tokenizer": {"path": TARGET["path"], "sha256": None}, "layer_ids": LAYER_IDS,
        "hidden_size": HIDDEN, "storage_dtype": storage, "num_shards_planned": 1,
        "shards": [info.to_dict()],
    })  # fmt: skip
    return root


@pytest.mark.parametrize("storage", ["bfloat16", "fp8_e4m3", "float16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_a_stored_row_gives_the_old_rows_values(tmp_path, storage, dtype):
    """The loader used to decode each sample (``decode_hidden``) and copy its layers into
    the row; the stored row decoded by ``model_batch`` holds the same values, bit for bit."""
    ds = open_dataset(stored_dataset(tmp_path / "ds", storage), dtype)
    rows = pack(ds.lengths, 12, 0)
    packed = PackedDataset(ds, rows, 12)
    for r, row in enumerate(rows):
        got = model_batch(packed[r], packed.layout, dtype)
        start = 0
        for i in row:
            s = ds[i]  # decode_hidden of the sample, as the old loader read it
            n = len(s["input_ids"])
            h = s["hidden_states"]
            assert torch.equal(got["aux_states"][start : start + n], h[:, :3].reshape(n, -1))
            assert torch.equal(got["teacher_states"][start : start + n], h[:, 3])
            start += n
        assert got["aux_states"].dtype == dtype and (got["aux_states"][start:] == 0).all()


def test_side_stream_copy_off_cuda_is_a_plain_copy():
    batch = {"a": torch.arange(4)}
    assert torch.equal(SideStreamCopy()(batch, torch.device("cpu"))["a"], batch["a"])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("storage", ["bfloat16", "fp8_e4m3"])
def test_on_cuda_pinned_side_stream_copy_and_device_decode_match_the_cpu(tmp_path, storage):
    """Pinned batches copied on the side stream and decoded on the GPU equal the CPU's
    decode; the pooled buffers are released once copied."""
    from draftsmith.train.batch_pool import SLOT_KEY

    data = stored_dataset(tmp_path / "ds", storage)
    dm = StatesDataModule(str(data), row_tokens=12, batch_size=2, val_fraction=0.0,
                          num_workers=1, dtype="bfloat16", order="shards")  # fmt: skip
    loader = dm.train_dataloader()
    assert loader.pin_memory
    device = torch.device("cuda")
    for batch in loader:
        assert batch["states"].is_pinned()
        cpu = dm.model_batch({k: v.clone() for k, v in batch.items()})
        slot = batch.get(SLOT_KEY)
        on_gpu = dm.on_after_batch_transfer(dm.transfer_batch_to_device(batch, device, 0), 0)
        torch.cuda.synchronize()
        assert dm.copy.stream is not None  # the side stream was used
        for k, v in cpu.items():
            assert on_gpu[k].device.type == "cuda" and torch.equal(on_gpu[k].cpu(), v), k
        if slot is not None:
            pool = loader.dataset.pool
            assert pool.busy[int(slot[1])] == 0  # released once copied
