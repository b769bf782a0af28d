"""Packed training data: packing, row layout, layer split, split, workers, noise, vocab."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from draftsmith.core.files import write_json_atomic
from draftsmith.core.targets import TargetInfo
from draftsmith.dataset.reader import DatasetError, open_dataset
from draftsmith.dataset.shards import write_shard
from draftsmith.drafters.attention.ttt import document_causal_mask, shift_tokens
from draftsmith.drafters.losses.acceptance import step_validity
from draftsmith.drafters.target.vocab import draft_vocab
from draftsmith.train.batches import model_batch
from draftsmith.train.data import StatesDataModule, token_counts
from draftsmith.train.packing import (
    PAD_DOC_ID,
    PackedDataset,
    RowSampler,
    collate,
    pack,
    split_samples,
)

LAYER_IDS = [2, 4, 5, 8]
NUM_LAYERS = 8
HIDDEN = 16
VOCAB = 64
TARGET = dict(path="/models/tiny", config_sha256="abc123", num_hidden_layers=NUM_LAYERS)


def make_samples(lengths: list[int], seed: int, layer_ids: list[int]) -> list[dict]:
    """Integer-valued states (exact in float32; noise shows up as non-integers)."""
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "id": f"s{seed}-{k}",
            "input_ids": torch.randint(0, VOCAB, (t,), generator=g),
            "loss_mask": torch.rand(t, generator=g) > 0.3,
            "hidden_states": torch.randint(
                -99, 100, (t, len(layer_ids), HIDDEN), generator=g
            ).float(),
        }
        for k, t in enumerate(lengths)
    ]


def write_dataset(
    root: Path,
    shards: list[list[int]],
    layer_ids: list[int] = LAYER_IDS,
    complete: bool = True,
) -> list[dict]:
    """Write shards of samples with the given lengths; return the samples in dataset order."""
    root.mkdir(parents=True, exist_ok=True)
    samples, infos = [], []
    for k, lengths in enumerate(shards):
        shard = make_samples(lengths, seed=k, layer_ids=layer_ids)
        infos.append(write_shard(root / f"shard-{k:05d}.safetensors", shard, "float32").to_dict())
        samples += shard
    manifest = {
        "format": "draftsmith.hidden_states",
        "format_version": 1,
        "complete": complete,
        "target": {**TARGET, "architecture": "LlamaForCausalLM", "vocab_size": VOCAB},
        "tokenizer": {"path": TARGET["path"], "sha256": None},
        "layer_ids": layer_ids,
        "hidden_size": HIDDEN,
        "storage_dtype": "float32",
        "num_shards_planned": len(shards),
        "shards": infos,
    }
    write_json_atomic(root / "manifest.json", manifest)
    return samples


LENGTHS = [[5, 3, 7, 2, 4], [6, 1, 9, 3, 8, 2, 5]]


@pytest.fixture
def dataset(tmp_path) -> tuple[Path, list[dict]]:
    return tmp_path / "ds", write_dataset(tmp_path / "ds", LENGTHS)


def decoded(packed: PackedDataset, item: dict) -> dict:
    """A stored row or batch as the drafters read it (what happens on the device)."""
    return model_batch(item, packed.layout, packed.ds.dtype)


def check_row(item: dict, rows: list[int], samples: list[dict], t: int, aux: list[int]) -> None:
    """Every token of a packed row (decoded) against the samples it holds, then the padding."""
    aux_idx, teacher_idx = [LAYER_IDS.index(i) for i in aux], LAYER_IDS.index(NUM_LAYERS)
    start = 0
    for doc, i in enumerate(rows):
        s = samples[i]
        n = min(len(s["input_ids"]), t - start)
        span = slice(start, start + n)
        h = s["hidden_states"][:n]
        assert torch.equal(item["input_ids"][span], s["input_ids"][:n])
        assert torch.equal(item["loss_mask"][span], s["loss_mask"][:n])
        assert torch.equal(item["position_ids"][span], torch.arange(n))
        assert (item["doc_ids"][span] == doc).all()
        assert torch.equal(item["aux_states"][span], h[:, aux_idx].reshape(n, -1))
        assert torch.equal(item["teacher_states"][span], h[:, teacher_idx])
        start += n
    pad = slice(start, t)
    assert (item["doc_ids"][pad] == PAD_DOC_ID).all()
    assert not item["loss_mask"][pad].any()
    assert (item["aux_states"][pad] == 0).all() and (item["input_ids"][pad] == 0).all()
    assert torch.equal(item["position_ids"][pad], torch.arange(t - start))


@pytest.mark.parametrize("seed", [None, 0, 7])
def test_pack_covers_every_sample_once_within_row_tokens(seed):
    lengths = torch.randint(1, 300, (500,), generator=torch.Generator().manual_seed(1)).tolist()
    lengths[:3] = [1000, 257, 256]  # one longer than a row: counts as a full row
    rows = pack(lengths, 256, seed)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(min(lengths[i], 256) for i in row) <= 256 for row in rows)
    total = sum(min(n, 256) for n in lengths)
    assert len(rows) <= math.ceil(total / 256) * 11 / 9 + 1  # first/best-fit-decreasing bound
    assert pack(lengths, 256, seed) == rows
    if seed is not None:
        assert pack(lengths, 256, seed + 1) != rows
    with pytest.raises(ValueError):
        pack(lengths, 0, seed)


def test_packed_rows_layout(dataset):
    path, samples = dataset
    ds = open_dataset(path)
    rows = pack(ds.lengths, 12, 0)
    assert len(rows) < len(samples)  # some rows hold several documents
    packed = PackedDataset(ds, rows, 12)
    assert packed.aux_layer_ids == [2, 4, 5] and packed.teacher_layer_id == 8
    items = [packed[r] for r in range(len(packed))]
    assert items[0]["states"].shape == (12, 4, HIDDEN)  # stored: every layer the head reads
    for item, row in zip(items, rows, strict=True):
        item = decoded(packed, item)
        assert item["aux_states"].shape == (12, 3 * HIDDEN)
        assert item["teacher_states"].shape == (12, HIDDEN)
        check_row(item, row, samples, 12, [2, 4, 5])
    whole = packed.__getitems__(list(range(len(rows))))  # what a DataLoader asks for
    assert all(torch.equal(whole[k], collate(items)[k]) for k in whole)
    batch = decoded(packed, collate(whole))
    assert batch["aux_states"].shape == (len(rows), 12, 3 * HIDDEN)
    assert batch["loss_mask"].dtype == torch.bool and batch["doc_ids"].shape == (len(rows), 12)
    # Padding is its own document: no attention, shifted token or label crosses into it.
    real = batch["doc_ids"] != PAD_DOC_ID
    assert (~real).any()
    mask = document_causal_mask(batch["doc_ids"])[:, 0]  # [B, T, T]
    assert not (mask & real[:, :, None] & ~real[:, None, :]).any()
    assert not (mask & ~real[:, :, None] & real[:, None, :]).any()
    assert mask.diagonal(dim1=1, dim2=2).all()  # every query (padding too) sees itself
    for shift in (1, 2, 3):
        marked = torch.where(real, batch["input_ids"] + 1, -5)  # real ids > 0, padding -5
        shifted = shift_tokens(marked, batch["doc_ids"], shift, pad_id=0)
        assert (shifted[real] >= 0).all() and (shifted[~real] <= 0).all()
        assert (shifted[real] == 0).any()  # a document's last tokens see no padding token
        assert not step_validity(batch["loss_mask"], batch["doc_ids"], shift - 1)[~real].any()


def test_aux_layers_choose_and_order_layers(dataset):
    path, samples = dataset
    ds = open_dataset(path)
    rows = pack(ds.lengths, 12, None)
    eagle1 = PackedDataset(ds, rows, 12, aux_layers=[8])
    assert eagle1[0]["states"].shape == (12, 1, HIDDEN)  # the one layer it reads
    row = decoded(eagle1, eagle1[0])
    check_row(row, rows[0], samples, 12, [8])
    assert torch.equal(row["aux_states"], row["teacher_states"])
    unordered = PackedDataset(ds, rows, 12, aux_layers=[5, 2])
    assert unordered.aux_layer_ids == [2, 5]
    check_row(decoded(unordered, unordered[1]), rows[1], samples, 12, [2, 5])
    for bad in ([3], [2, 2], []):
        with pytest.raises(DatasetError, match="aux_layers"):
            PackedDataset(ds, rows, 12, aux_layers=bad)


def test_long_samples_are_truncated_and_counted(tmp_path, capsys):
    samples = write_dataset(tmp_path, [[20, 4, 11]])
    dm = StatesDataModule(str(tmp_path), row_tokens=10, val_fraction=0.0, num_workers=0)
    said = capsys.readouterr().out
    assert "2 of 3 samples are longer than data.row_tokens=10" in said
    assert "11 of 35 tokens" in said and "data.row_tokens to 20" in said
    assert dm.num_truncated == 2 and dm.tokens_cut == 11 and dm.val_dataloader() == []
    loader = dm.train_dataloader()
    for item, row in zip(loader.dataset, loader.dataset.rows, strict=True):
        check_row(decoded(loader.dataset, item), row, samples, 10, [2, 4, 5])
    assert sum(int((b["doc_ids"] >= 0).sum()) for b in loader) == 10 + 4 + 10


def test_a_dataset_of_the_last_layer_alone_feeds_no_aux_states(tmp_path):
    """What a pipeline extracts for model.kind mtp: layer N alone, the teacher's input."""
    samples = write_dataset(tmp_path, [[3, 4]], layer_ids=[8])
    dm = StatesDataModule(str(tmp_path), row_tokens=8, val_fraction=0.0, num_workers=0)
    assert dm.aux_layer_ids == [] and dm.teacher_layer_id == 8
    packed = dm.train_dataloader().dataset
    item, first = decoded(packed, packed[0]), samples[packed.rows[0][0]]["hidden_states"]
    assert item["aux_states"].shape == (8, 0)
    assert torch.equal(item["teacher_states"][: len(first)], first[:, 0])


def test_missing_last_layer_gives_teacher_error(tmp_path):
    write_dataset(tmp_path, [[3, 4]], layer_ids=[2, 4, 5])
    with pytest.raises(DatasetError, match=r"no last-layer states.*--layer_ids \[2, 4, 5, 8\]"):
        StatesDataModule(str(tmp_path), num_workers=0)
    with pytest.raises(DatasetError, match="no last-layer states"):
        PackedDataset(open_dataset(tmp_path), [[0, 1]], 8)


def test_missing_or_unfinished_dataset_errors(tmp_path):
    with pytest.raises(DatasetError, match="not a draftsmith dataset"):
        StatesDataModule(str(tmp_path / "nowhere"))
    write_dataset(tmp_path / "partial", [[3]], complete=False)
    with pytest.raises(DatasetError, match="unfinished"):
        StatesDataModule(str(tmp_path / "partial"))


def test_val_split_is_disjoint_and_deterministic(dataset):
    path, samples = dataset
    for n, frac in ((12, 0.25), (100, 0.05), (2, 0.01), (5, 0.001)):
        train, val = split_samples(n, frac, seed=3)
        assert sorted(train + val) == list(range(n)) and not set(train) & set(val)
        assert len(val) == max(1, round(n * frac))
        assert split_samples(n, frac, seed=3) == (train, val)
    assert split_samples(100, 0.1, 3) != split_samples(100, 0.1, 4)
    assert split_samples(1, 0.5, 0) == ([0], [])
    assert split_samples(10, 0.0, 0) == (list(range(10)), [])
    # Per-turn samples of one conversation stay together on one side of the split.
    ids = [f"chat:{c}#{t}" for c in range(10) for t in range(3)] + ["plain:1", "plain:2"]
    train, val = split_samples(len(ids), 0.2, seed=3, ids=ids)
    assert sorted(train + val) == list(range(len(ids)))
    conv = {ids[i].partition("#")[0] for i in val}
    assert len(conv) == 2  # 0.2 of the 12 conversations, each with all its samples
    assert not conv & {ids[i].partition("#")[0] for i in train}
    assert sum(ids[i].startswith(tuple(conv)) for i in val) == len(val)
    dm = StatesDataModule(str(path), row_tokens=16, val_fraction=0.25, num_workers=0, seed=1)
    assert len(dm.val_indices) == 3
    val_rows = dm.val_dataloader().dataset.rows
    train_rows = dm.train_dataloader().dataset.rows
    assert sorted(i for r in val_rows for i in r) == dm.val_indices
    assert sorted(i for r in train_rows for i in r) == dm.train_indices


def batches(loader) -> list[dict]:
    return list(loader)


def assert_same_batches(a: list[dict], b: list[dict]) -> None:
    """Same batches (the pool slot a worker filled, where it used one, aside)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        x, y = ({k: v for k, v in d.items() if k != "pool_slot"} for d in (x, y))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_workers_give_the_same_batches(dataset):
    path, _ = dataset
    kw = dict(row_tokens=10, batch_size=2, val_fraction=0.25, seed=5)
    dm0 = StatesDataModule(str(path), num_workers=0, **kw)
    dm2 = StatesDataModule(str(path), num_workers=2, **kw)
    assert_same_batches(batches(dm0.train_dataloader()), batches(dm2.train_dataloader()))
    assert_same_batches(batches(dm0.val_dataloader()), batches(dm2.val_dataloader()))


def test_train_order_reshuffles_each_epoch(dataset):
    path, _ = dataset
    dm = StatesDataModule(str(path), row_tokens=9, val_fraction=0.0, num_workers=0, seed=2)
    loader = dm.train_dataloader()
    first = batches(loader)
    assert len(first) >= 6
    ids = [b["input_ids"].tolist() for b in first]
    assert ids == [b["input_ids"].tolist() for b in batches(loader)]  # same epoch, same order
    loader.sampler.set_epoch(1)
    second = [b["input_ids"].tolist() for b in batches(loader)]
    assert ids != second and sorted(ids) == sorted(second)


def test_ranks_share_out_rows_and_resume_skips_finished_batches(dataset):
    path, _ = dataset
    dm = StatesDataModule(str(path), row_tokens=9, val_fraction=0.0, num_workers=0, seed=2)
    whole = dm.train_dataloader().sampler
    ranks = [RowSampler(whole.num_rows, 2, rank, 2) for rank in range(2)]
    for s in [whole, *ranks]:
        s.set_epoch(3)
    dealt = [list(s) for s in ranks]
    assert len(dealt[0]) == len(dealt[1]) == -(-whole.num_rows // 2)
    assert set(dealt[0] + dealt[1]) == set(range(whole.num_rows))  # every row, padding wraps
    assert sorted(dealt[0][: whole.num_rows // 2] + dealt[1][: whole.num_rows // 2]) == sorted(
        list(whole)[: 2 * (whole.num_rows // 2)]
    )

    # A checkpoint taken after 2 batches of epoch 1 resumes with the rest of that epoch.
    dm = StatesDataModule(
        str(path), row_tokens=9, batch_size=2, val_fraction=0.0, num_workers=0, seed=2
    )
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(1)
    full = [b["input_ids"].tolist() for b in batches(loader)]
    fresh = StatesDataModule(
        str(path), row_tokens=9, batch_size=2, val_fraction=0.0, num_workers=0, seed=2
    ).train_dataloader()
    fresh.load_state_dict({"epoch": 1, "batches_done": 2})
    fresh.sampler.set_epoch(1)  # Lightning calls it again for the same epoch: no reset
    assert [b["input_ids"].tolist() for b in batches(fresh)] == full[2:]
    assert len(batches(fresh)) == len(full)  # the next pass is a whole epoch again


def is_noisy(batch: dict) -> bool:
    aux = batch["aux_states"]
    return bool((aux != aux.round()).any())


def test_noise_only_on_training_batches(dataset):
    path, _ = dataset
    dm = StatesDataModule(
        str(path), row_tokens=12, batch_size=16, val_fraction=0.0, num_workers=0, noise_std=0.5
    )
    stored = next(iter(dm.train_dataloader()))  # every row: some padding among them
    batch = dm.model_batch(stored)
    assert not is_noisy(batch)
    dm.trainer = SimpleNamespace(training=False)
    plain = dm.on_after_batch_transfer(stored, 0)
    assert plain.keys() == batch.keys() and all(torch.equal(plain[k], batch[k]) for k in batch)
    dm.trainer = SimpleNamespace(training=True)
    noisy = dm.on_after_batch_transfer(stored, 0)
    real = batch["doc_ids"] != PAD_DOC_ID
    assert (~real).any()
    diff = noisy["aux_states"] - batch["aux_states"]
    assert (diff[real] != 0).all() and (diff[~real] == 0).all()
    assert 0.4 < float(diff[real].std()) < 0.6
    assert all(torch.equal(noisy[k], batch[k]) for k in batch if k != "aux_states")


class Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[str, bool]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(("train", is_noisy(batch)))
        return (self.w * batch["aux_states"].mean()).sum()

    def validation_step(self, batch, batch_idx):
        self.seen.append(("val", is_noisy(batch)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("val_fraction", [0.25, 0.0])
def test_noise_in_a_real_fit_touches_training_batches_only(dataset, val_fraction):
    path, _ = dataset
    dm = StatesDataModule(
        str(path), row_tokens=12, val_fraction=val_fraction, num_workers=0, noise_std=0.1
    )
    model = Recorder()
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=dm)
    kinds = {kind for kind, _ in model.seen}
    assert kinds == ({"train", "val"} if val_fraction else {"train"})
    assert all(noisy == (kind == "train") for kind, noisy in model.seen)


def test_token_counts_match_brute_force(tmp_path):
    write_dataset(tmp_path, [[5, 30, 7], [12], [40, 3]])
    ds = open_dataset(tmp_path)

    def brute(samples):
        want = torch.zeros(VOCAB, dtype=torch.long)
        for i in samples:
            s = ds[i]
            for tok, m in zip(s["input_ids"].tolist(), s["loss_mask"].tolist(), strict=True):
                want[tok] += m
        return want

    assert torch.equal(token_counts(ds, VOCAB), brute(range(len(ds))))
    for subset in ([0, 4], [3], [1, 2, 5]):  # across shards: the vocabulary of a training split
        assert torch.equal(token_counts(ds, VOCAB, subset), brute(subset))
    assert token_counts(ds, VOCAB, []).sum() == 0
    with pytest.raises(DatasetError, match="outside a vocabulary of 10"):
        token_counts(ds, 10)


def test_draft_vocab_most_frequent_with_forced_ids():
    counts = torch.tensor([5, 0, 9, 5, 1, 9, 0, 2])
    assert draft_vocab(counts, 3).tolist() == [0, 2, 5]  # 9, 9, then the lower of the 5s
    got = draft_vocab(counts, 4, always=[6, 1])
    assert got.tolist() == [1, 2, 5, 6]
    assert draft_vocab(counts, 8, always=[6]).tolist() == list(range(8))
    for size, always in ((0, None), (9, None), (1, [1, 6]), (3, [8])):
        with pytest.raises(ValueError):
            draft_vocab(counts, size, always)


@pytest.mark.parametrize(
    "field, value",
    [("hidden_size", 32), ("vocab_size", 100), ("num_hidden_layers", 12), ("config_sha256", "x")],
)
def test_check_target_names_the_mismatch(dataset, field, value):
    path, _ = dataset
    dm = StatesDataModule(str(path), num_workers=0)
    assert (dm.hidden_size, dm.layer_ids, dm.aux_layer_ids) == (HIDDEN, LAYER_IDS, [2, 4, 5])
    assert dm.target_path == TARGET["path"] and dm.manifest["hidden_size"] == HIDDEN
    facts = dict(
        path=TARGET["path"], architecture="LlamaForCausalLM", hidden_size=HIDDEN,
        num_hidden_layers=NUM_LAYERS, vocab_size=VOCAB, config_sha256=TARGET["config_sha256"],
    )  # fmt: skip
    dm.check_target(TargetInfo(**facts))
    with pytest.raises(DatasetError, match=f"{field} .* != {value!r} \\(target\\)") as err:
        dm.check_target(TargetInfo(**{**facts, field: value}))
    others = {"hidden_size", "vocab_size", "num_hidden_layers", "config_sha256"} - {field}
    assert not any(f"{other} " in str(err.value) for other in others)


def test_dtype_of_states(dataset):
    path, samples = dataset
    dm = StatesDataModule(str(path), row_tokens=12, num_workers=0, dtype="bfloat16")
    batch = dm.model_batch(next(iter(dm.train_dataloader())))
    assert batch["aux_states"].dtype == torch.bfloat16
    assert batch["teacher_states"].dtype == torch.bfloat16


def test_val_data_validates_on_another_dataset_and_trains_on_all_of_data(tmp_path, dataset):
    path, samples = dataset
    val_samples = write_dataset(tmp_path / "val", [[4, 6, 3]])
    dm = StatesDataModule(str(path), row_tokens=32, val_data=str(tmp_path / "val"), num_workers=0)
    assert dm.train_indices == list(range(len(samples)))  # val_fraction is ignored
    assert dm.val_indices == [0, 1, 2]
    docs = [row[row >= 0] for batch in dm.val_dataloader() for row in batch["doc_ids"]]
    seen = sorted(int(n) for d in docs for n in torch.bincount(d))
    # the val rows hold the validation samples' tokens, not the training set's
    assert seen == sorted(len(s["input_ids"]) for s in val_samples)
    write_dataset(tmp_path / "other", [[4]], layer_ids=[1, 2, NUM_LAYERS])
    with pytest.raises(DatasetError, match="data.val_data: .*other has layer_ids"):
        StatesDataModule(str(path), val_data=str(tmp_path / "other"), num_workers=0)


def test_a_dataset_stopped_by_its_time_limit_is_read_whole_shards_only(tmp_path):
    samples = write_dataset(tmp_path / "ds", LENGTHS, complete=False)
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    with pytest.raises(DatasetError, match="extraction is unfinished"):
        StatesDataModule(str(tmp_path / "ds"), num_workers=0)
    manifest["stopped_by"] = "time_limit"
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps(manifest))
    dm = StatesDataModule(str(tmp_path / "ds"), val_fraction=0.0, num_workers=0)
    assert len(dm.dataset) == len(samples)


SHARDED = [[5, 3, 7, 2, 4], [6, 1, 9, 3, 8, 2, 5], [4], [7, 7, 2, 3], [1, 2, 3, 4, 5, 6, 8]]


def shard_loader(path: Path, workers: int):
    kw = dict(row_tokens=9, batch_size=2, val_fraction=0.2, seed=3, order="shards")
    return StatesDataModule(str(path), num_workers=workers, **kw).train_dataloader()


def test_shard_order_gives_the_same_batches_with_any_number_of_workers(tmp_path):
    """Worker j % W reads batch j and the DataLoader takes them in turn: the same batches
    in the same order for 0 to 3 workers, also resumed mid-epoch (the skip applies to that
    pass only)."""
    write_dataset(tmp_path / "ds", SHARDED)
    reference = batches(shard_loader(tmp_path / "ds", 0))
    assert len(reference) == 8  # shards of 1 or 2 batches: the workers' turns cross them
    for workers in (1, 2, 3):
        loader = shard_loader(tmp_path / "ds", workers)
        assert loader.num_workers == workers
        assert_same_batches(batches(loader), reference)
        loader.load_state_dict({"batches_done": 5})
        assert_same_batches(batches(loader), reference[5:])
        assert_same_batches(batches(loader), reference)  # the next pass is whole again


def test_shard_order_workers_fill_buffers_made_once_before_they_fork(tmp_path, monkeypatch):
    """The shard-order loader starts its workers again every pass; they inherit batch
    buffers the training process made and touched once, and fill them again once released,
    so no pass of theirs makes shared memory, and each pass's batches are the reference's."""
    import multiprocessing

    from draftsmith.train import batch_pool
    from draftsmith.train import batches as stored
    from draftsmith.train.batch_pool import release

    write_dataset(tmp_path / "ds", SHARDED)
    reference = batches(shard_loader(tmp_path / "ds", 0))
    made = multiprocessing.Value("i", 0)  # counts in the workers too (forked)
    real = batch_pool.shared

    def counted(shape, dtype):
        with made.get_lock():
            made.value += 1
        return real(shape, dtype)

    monkeypatch.setattr(batch_pool, "shared", counted)
    monkeypatch.setattr(stored, "shared", counted)
    loader = shard_loader(tmp_path / "ds", 2)
    for _ in range(2):
        got = []
        for batch in loader:
            got.append({k: v.clone() for k, v in batch.items()})
            release(batch)  # as training does once the batch is decoded or on the GPU
        assert_same_batches(got, reference)
    assert any(len(b["input_ids"]) == 1 for b in reference)  # a shard's last: fewer rows
    per_slot = len(reference[0]) + 1  # the batch's tensors and the slot's tag
    assert made.value == 2 * loader.dataset.pool_slots * per_slot  # made once, before forking


def corrupt_first_sample(root: Path, shard_index: int) -> None:
    from draftsmith.dataset.shards import read_header

    shard = root / f"shard-{shard_index:05d}.safetensors"
    spec = read_header(shard)[0]["hidden_states"]
    data = bytearray(shard.read_bytes())
    data[spec.start + 4 * HIDDEN] ^= 0xFF  # a state of the first sample, same size
    shard.write_bytes(bytes(data))


def test_shard_order_refuses_a_corrupt_sample_before_its_batch_trains(tmp_path):
    """Each sample is checked (xxh3-64) on the bytes just read, by whichever worker reads
    it: the flipped byte fails the batch holding that sample, in one line naming the shard
    and the sample; every batch before it is the clean run's, with any number of workers."""
    write_dataset(tmp_path / "ds", SHARDED)
    plan = StatesDataModule(str(tmp_path / "ds"), row_tokens=9, batch_size=2, val_fraction=0.2,
                            seed=3, order="shards", num_workers=0)._shard_plan()  # fmt: skip
    before = sum(plan.batches(k, plan.info(k)) for k in (0, 1, 2))
    reference = batches(shard_loader(tmp_path / "ds", 0))
    corrupt_first_sample(tmp_path / "ds", 3)
    failed_at = set()
    for workers in (0, 2, 3):
        seen = []
        with pytest.raises(DatasetError, match="xxh3-64") as err:
            for batch in shard_loader(tmp_path / "ds", workers):
                seen.append(batch)
        line = str(err.value)  # from a worker: torch's "Caught ..." around it (the CLI
        assert "shard-00003.safetensors: sample 's3-0'" in line  # unwraps it to the line)
        assert "--repair true" in line and (workers or "\n" not in line)
        assert before <= len(seen) < before + plan.batches(3, plan.info(3))
        assert_same_batches(seen, reference[: len(seen)])
        failed_at.add(len(seen))
    assert len(failed_at) == 1  # the same batch whatever the worker count


def test_an_older_shard_is_hashed_whole_once_per_run(tmp_path, monkeypatch):
    """A shard without per-sample checksums (written before them) is refused whole by its
    sha256 before any of its batches, as before; a clean one is hashed once per run, not
    once per epoch."""
    import draftsmith.core.files as files

    write_dataset(tmp_path / "ds", SHARDED)
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    for info in manifest["shards"]:
        del info["sample_xxh3"]
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps(manifest))
    hashed = []
    real = files.sha256_file
    monkeypatch.setattr(files, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    loader = shard_loader(tmp_path / "ds", 0)
    reference = batches(loader)
    assert sorted(hashed) == sorted(set(hashed)) and len(hashed) == len(SHARDED)
    assert_same_batches(batches(loader), reference)  # a second epoch: nothing hashed again
    assert len(hashed) == len(SHARDED)
    plan = loader.dataset.plan
    before = sum(plan.batches(k, plan.info(k)) for k in (0, 1, 2))
    corrupt_first_sample(tmp_path / "ds", 3)
    for workers in (0, 2, 3):
        seen = []
        with pytest.raises(DatasetError, match="shard-00003.safetensors: sha256 differs"):
            for batch in shard_loader(tmp_path / "ds", workers):
                seen.append(batch)
        assert_same_batches(seen, reference[:before])


def test_workers_refill_only_the_batch_buffers_the_trainer_released(dataset):
    """A worker reuses a batch's shared memory once the training process releases it, so
    later batches are the same as fresh ones; one never released is never written again."""
    from torch.utils.data import DataLoader

    from draftsmith.train.batch_pool import SLOT_KEY, BatchPool, release

    path, _ = dataset
    ds = open_dataset(path)
    rows = pack(ds.lengths, 6, 0)
    reference = [PackedDataset(ds, rows, 6)[r] for r in range(len(rows))]
    assert len(rows) >= 8

    def run(release_each: bool) -> tuple[list[dict], list[int]]:
        packed = PackedDataset(ds, rows, 6, pool=BatchPool(workers=1, slots=3))
        loader = DataLoader(packed, batch_size=1, num_workers=1, collate_fn=collate,
                            prefetch_factor=1)  # fmt: skip
        got, slots = [], []
        for batch in loader:
            slots.append(int(batch[SLOT_KEY][1]) if SLOT_KEY in batch else -1)
            got.append({k: v[0].clone() for k, v in batch.items() if k != SLOT_KEY})
            if release_each:
                release(batch)
            else:
                got[-1]["kept"] = batch  # held, as a consumer unaware of the pool would
        return got, slots

    got, slots = run(release_each=True)
    assert len(set(slots)) < len(slots) and -1 not in slots  # slots were reused
    kept, kept_slots = run(release_each=False)
    assert kept_slots[:3] == [0, 1, 2] and set(kept_slots[3:]) == {-1}  # then fresh memory
    for a, b, ref in zip(got, kept, reference, strict=True):
        assert all(torch.equal(a[k], ref[k]) and torch.equal(b[k], ref[k]) for k in ref)
    for b, ref in zip(kept[:3], reference[:3], strict=True):  # held: their contents kept
        held = b["kept"]
        assert all(torch.equal(held[k][0], ref[k]) for k in ref)
