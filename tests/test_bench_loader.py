"""`draftsmith bench-loader` on tiny shapes: the table, the JSON, and every token read."""

from __future__ import annotations

import json

from draftsmith.bench.loader import main, sample_lengths
from draftsmith.dataset.shards import bytes_per_token

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16,
    "num_hidden_layers": 8,
    "vocab_size": 64,
    "max_position_embeddings": 2048,
}


def test_sample_lengths_sum_to_tokens():
    lengths = sample_lengths(1000, 40, seed=3)
    assert sum(lengths) == 1000
    assert all(1 <= n <= 60 for n in lengths)
    assert all(n >= 20 for n in lengths[:-1])  # only the last one is cut


def test_bench_loader_reads_every_written_token(tmp_path, capsys):
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "result.json"
    args = [
        f"--model={target}",
        "--tokens=300",
        "--sample_tokens=40",
        "--samples_per_shard=4",
        "--row_tokens=64",
        "--batch_size=2",
        "--workers=[0, 1]",
        f"--work_dir={tmp_path / 'work'}",
        f"--output={out}",
    ]
    assert main(args) == 0

    result = json.loads(out.read_text())
    assert result["shape"]["layer_ids"] == [2, 4, 5, 8]  # extract's default taps for N=8
    assert set(result["datasets"]) == {"bfloat16", "fp8_e4m3"}
    for storage, info in result["datasets"].items():
        assert info["tokens_written"] == 300
        assert info["bytes_per_token"] == bytes_per_token(4, 16, storage)
        assert info["file_bytes_per_token"] > info["bytes_per_token"]  # + headers, offsets
    passes = result["passes"]
    combos = [(p["storage_dtype"], p["cache"], p["workers"]) for p in passes]
    assert combos == [
        (s, c, w) for s in ("bfloat16", "fp8_e4m3") for c in ("cold", "warm") for w in (0, 1)
    ]
    for p in passes:
        assert p["tokens"] == 300  # every written token came out of the loader, once
        assert p["first_epoch_tokens"] == 300  # and once more in the untimed first epoch
        assert p["first_epoch_s"] >= p["first_batch_s"] > 0
        assert p["first_epoch_x_raw"] > 0
        assert p["row_tokens"] % 64 == 0 and p["row_tokens"] >= 300
        assert p["tokens_per_s"] > 0 and p["seconds"] > 0
        if p["cache"] == "warm" and p["resident_before"] is not None:
            assert p["resident_before"] == 1.0
    assert result["pin_memory"] is False or result["pin_memory"] is True
    assert not any((tmp_path / "work").iterdir())  # the shards were removed

    text = capsys.readouterr().out
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("storage"))
    rows = lines[header + 1 : header + 1 + len(passes)]
    assert [r.split()[:4] for r in rows] == [[s, c, str(w), "300"] for s, c, w in combos]
    assert "bytes/token" in text and "x raw" in text and "where a token's time goes" in text

    # x raw: each pass against one plain sequential read of the same files, same cache state
    raw = {(r["storage_dtype"], r["cache"]): r for r in result["raw_reads"]}
    assert sorted(raw) == sorted({(s, c) for s, c, _ in combos})
    for (storage, _), r in raw.items():
        assert r["bytes"] == round(300 * result["datasets"][storage]["file_bytes_per_token"])
    for p in passes:
        base = raw[(p["storage_dtype"], p["cache"])]
        assert p["x_raw"] == p["disk_mb_per_s"] / base["mb_per_s"]
    # the breakdown: one in-process pass per storage and cache, its phases sum to its time
    phases = result["breakdown"]
    assert [(b["storage_dtype"], b["cache"]) for b in phases] == list(raw)
    for b in phases:
        assert b["tokens"] == 300
        assert {"open", "read", "checksum", "pack", "collate", "decode"} <= set(b["phases_s"])
        assert abs(sum(b["phases_s"].values()) - b["seconds"]) < 1e-6


def test_bench_loader_rejects_samples_longer_than_rows(tmp_path, capsys):
    code = main(["--sample_tokens=100", "--row_tokens=64", f"--work_dir={tmp_path}"])
    assert code == 2
    assert "sample_tokens: 100" in capsys.readouterr().err


def test_bench_train_with_data_times_the_loaders_own_batches(tmp_path):
    """``bench-train --data``: every timed step trains the next batch the training loader
    gives (shard order, in a worker), and the real tokens it reports are those batches'."""
    from draftsmith.bench.train import BenchTrainConfig, run
    from draftsmith.train.data import StatesDataModule

    target = tmp_path / "tiny"
    target.mkdir()
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32}
    (target / "config.json").write_text(json.dumps({**TINY, **heads}))  # a head is built
    args = [f"--model={target}", "--tokens=300", "--sample_tokens=40", "--samples_per_shard=4",
            "--storage_dtypes=[bfloat16]", "--caches=[warm]", "--workers=[0]", "--keep=true",
            f"--work_dir={tmp_path / 'work'}", "--output=null"]  # fmt: skip
    assert main(args) == 0
    data = next((tmp_path / "work").glob("shards-*/bfloat16"))
    cfg = BenchTrainConfig(model=str(target), random_weights=True, ttt_steps=1, row_tokens=64,
                           draft_vocab_size=64, steps=2, data=str(data), order="shards",
                           num_workers=1, cold=False)  # fmt: skip
    result = run(cfg)
    module = StatesDataModule(str(data), row_tokens=64, batch_size=1, val_fraction=0.0,
                              num_workers=0, order="shards")  # fmt: skip
    batches = list(module.train_dataloader())
    assert len(batches) >= 3  # the warm-up step, then the two timed ones
    assert result["real_tokens"] == sum(int((b["doc_ids"] >= 0).sum()) for b in batches[1:3])
    assert result["real_tokens_per_s"] > 0


def test_bench_loader_in_shard_order_reads_every_token_with_several_workers(tmp_path, capsys):
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "result.json"
    args = [f"--model={target}", "--tokens=300", "--sample_tokens=40", "--samples_per_shard=2",
            "--row_tokens=64", "--order=shards", "--workers=[0, 2, 3]",
            "--storage_dtypes=[bfloat16]", "--caches=[warm]", f"--work_dir={tmp_path / 'work'}",
            f"--output={out}"]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["config"]["order"] == "shards" and result["datasets"]["bfloat16"]["shards"] > 3
    assert [(p["workers"], p["tokens"]) for p in result["passes"]] == [(0, 300), (2, 300), (3, 300)]
    assert "shards order" in capsys.readouterr().out
