"""`draftsmith bench-gpu` on CPU at tiny shapes: every row, the MFU arithmetic by hand, the
profiles, the loader against the GPU rate, and the rows of a missing speculators."""

from __future__ import annotations

import json

import pytest

from draftsmith.train import bench_gpu, bench_speculators
from draftsmith.train.flops import StepFlops, peak_tflops

TINY_ROW = ["--row_tokens=32", "--draft_vocab_size=64", "--steps=1", "--profile_steps=1"]


def eagle3_params(h: int, heads: int, kv: int, head_dim: int, inter: int) -> int:
    """Trainable parameters of a one-layer EAGLE-3 head without its lm_head, by hand: fc
    [H, 3H]; q, k, v over [embedding; state] (2H); o; gate, up, down; four RMSNorm weights
    (input, hidden, post-attention, final)."""
    fc = 3 * h * h
    attention = 2 * h * heads * head_dim + 2 * (2 * h * kv * head_dim) + heads * head_dim * h
    return fc + attention + 3 * h * inter + 4 * h


def test_flops_and_peak_by_hand():
    f = StepFlops(trainable_params=1000, frozen_lm_head_params=200, teacher_params=200, ttt_steps=3)
    assert f.model == 6 * 1000 * 3 == 18000
    assert f.hardware == 18000 + 4 * 200 * 3 + 2 * 200 == 20800
    assert f.mfu(1e9, 100.0) == pytest.approx({"mfu_6nt": 0.18, "mfu_hw": 0.208})
    assert f.mfu(1e9, None) == {"mfu_6nt": None, "mfu_hw": None}
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0  # the SXM card
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("cpu") is None
    assert peak_tflops("NVIDIA H100 80GB HBM3", override=900.0) == 900.0


def test_flops_reproduce_the_h100_figures_of_gpu_md():
    """The Llama-3.1-8B head (H 4096, 32 heads of 128, 8 KV heads, MLP 14336, 32k draft
    vocabulary): 293,617,664 trainable parameters with the lm_head frozen; the H100 run's
    11,612 tok/s at TTT 7 was 14.5% MFU (6NT), and its frozen lm_head adds ~30% at TTT 3."""
    n = eagle3_params(4096, 32, 8, 128, 14336)
    lm = 32000 * 4096
    assert n == 293_617_664
    frozen = StepFlops(n, lm, lm, 7)
    assert frozen.mfu(11_612, 989.0)["mfu_6nt"] == pytest.approx(0.145, abs=5e-4)
    trained = StepFlops(n + lm, 0, lm, 7)
    assert trained.mfu(10_029, 989.0)["mfu_6nt"] == pytest.approx(0.181, abs=5e-4)
    ttt3 = StepFlops(n, lm, lm, 3)
    assert 4 * lm * 3 / ttt3.model == pytest.approx(0.30, abs=0.01)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, make_tiny_target):
    return make_tiny_target(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3", "qwen3")


def test_bench_gpu_end_to_end_on_cpu(tmp_path, monkeypatch, capsys, tiny_model_dir, qwen3_dir):
    monkeypatch.setattr(bench_speculators, "version", lambda: None)  # as on a bare device
    out = tmp_path / "out"
    targets = [str(tiny_model_dir), str(qwen3_dir)]
    args = [f"--targets={json.dumps(targets)}", "--ttt_steps=[1, 2]", *TINY_ROW,
            "--peak_tflops=2.0", "--loader_tokens=200", "--loader_sample_tokens=16",
            "--loader_workers=[0, 2]", f"--work_dir={tmp_path / 'work'}",
            f"--output={out}"]  # fmt: skip
    assert bench_gpu.main(args) == 0

    result = json.loads((out / "bench-gpu.json").read_text())
    assert result["command"] == "bench-gpu" and result["device"] == "cpu"
    rows = result["rows"]
    keys = [(r["trainer"], r["target"], r["ttt"], r["lm_head"]) for r in rows]
    assert keys == [("draftsmith", t, k, lm) for t in targets for k in (1, 2)
                    for lm in ("frozen", "trained")] + [
                    ("speculators", t, k, "frozen") for t in targets for k in (1, 2)]  # fmt: skip
    h, v = 128, 64  # tests/conftest.py TINY, and --draft_vocab_size
    n = eagle3_params(h, heads=2, kv=1, head_dim=64, inter=256)
    for r in rows[:8]:
        assert r["status"] == "ok", r
        trained = r["lm_head"] == "trained"
        assert r["trainable_params"] == n + (v * h if trained else 0)
        six_nt = 6 * r["trainable_params"] * r["ttt"]
        hw = six_nt + (0 if trained else 4 * v * h * r["ttt"]) + 2 * v * h
        assert (r["flops_per_token_6nt"], r["flops_per_token_hw"]) == (six_nt, hw)
        assert r["tokens_per_s"] == pytest.approx(32 / r["seconds_per_step"])
        assert r["mfu_6nt"] == pytest.approx(six_nt * r["tokens_per_s"] / 2e12)
        assert r["mfu_hw"] == pytest.approx(hw * r["tokens_per_s"] / 2e12)
        prof = r["profile"]
        assert prof["clock"] == "cpu ops (self time)" and prof["steps"] == 1
        assert 0 < prof["matmul_share"] <= 1 and 0 < prof["other_share"] < 1
        assert 1 <= len(prof["top_ops"]) <= 10
        assert "aten::mm" in [op["op"] for op in prof["top_ops"]]
        assert r["peak_rss_gib"] > 0
    for r in rows[8:]:
        assert r["status"].startswith("skipped: speculators is not installed"), r
        assert "tokens_per_s" not in r

    loader = result["loader"]
    assert loader["config"]["order"] == "shards"
    assert [(p["workers"], p["tokens"]) for p in loader["passes"]] == [(0, 200), (2, 200)]
    base = rows[0]  # the first target's frozen head at the smallest TTT
    assert loader["gpu_ttt"] == 1 and loader["gpu_tokens_per_s"] == base["tokens_per_s"]
    for p in loader["passes"]:
        assert p["x_gpu"] == pytest.approx(p["tokens_per_s"] / base["tokens_per_s"])

    page = (out / "bench-gpu.md").read_text()
    assert page.startswith("# bench-gpu: cpu") and page in capsys.readouterr().out
    table = [line for line in page.splitlines() if line.startswith("| draftsmith")]
    assert len(table) == 8 and all("%" in line for line in table)
    assert page.count("| speculators, ") == 4
    assert page.count("skipped: speculators is not installed") == 4
    assert page.count("\n### draftsmith, ") == 8  # one profile per draftsmith row
    assert "## Loader (shard order" in page and "| 2 | cold | 200 |" in page


def test_a_failing_row_is_recorded_and_every_row_saved(tmp_path, monkeypatch, tiny_model_dir):
    real = bench_gpu.draftsmith_row

    def flaky(cfg, target, ttt, lm_head, peak):
        if lm_head == "trained":
            raise RuntimeError("CUDA out of memory (planted)")
        return real(cfg, target, ttt, lm_head, peak)

    monkeypatch.setattr(bench_gpu, "draftsmith_row", flaky)
    cfg = bench_gpu.BenchGpuConfig(targets=[str(tiny_model_dir)], ttt_steps=[1], row_tokens=32,
                                   draft_vocab_size=64, steps=1, profile_steps=0,
                                   speculators=False, loader=False)  # fmt: skip
    saved: list[int] = []  # rows written out so far, after each row
    rows = bench_gpu.run(cfg, save=lambda result: saved.append(len(result["rows"])))["rows"]
    assert saved == [1, 2]
    failed = "failed: RuntimeError: CUDA out of memory (planted)"
    assert [r["status"] for r in rows] == ["ok", failed]
    assert "profile" not in rows[0] and rows[0]["mfu_6nt"] is None  # no peak known on CPU


def test_speculators_that_does_not_import_says_why(monkeypatch):
    import sys

    monkeypatch.setattr(bench_speculators, "version", lambda: "0.9.0")
    monkeypatch.setitem(sys.modules, "speculators", None)  # installed, but its import fails
    assert bench_gpu.speculators_missing().startswith("speculators does not import: ")


def test_speculators_row_on_cpu(tmp_path, tiny_model_dir):
    """speculators' own EAGLE-3 step at a tiny shape (its eager loss and sdpa on CPU)."""
    missing = bench_gpu.speculators_missing()
    if missing:
        pytest.skip(f"{missing}; the device run (tools/bench_gpu.sh) carries it")
    cfg = bench_gpu.BenchGpuConfig(row_tokens=32, draft_vocab_size=64, steps=1, profile_steps=1)
    row = bench_gpu.speculators_row(cfg, str(tiny_model_dir), 2, None)
    assert row["status"] == "ok" and row["tokens_per_s"] > 0
    assert row["speculators_version"] == bench_speculators.TESTED_VERSION
    lm = 64 * 128
    assert row["flops_per_token_hw"] == row["flops_per_token_6nt"] + 4 * lm * 2 + 2 * lm


def test_a_foreign_output_folder_is_refused(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    assert bench_gpu.main([f"--output={out}"]) == 2
    assert "output" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["thesis.tex"]


def test_profile_summary_of_gpu_kernels_by_name():
    """The CUDA branch, on recorded events: GEMM kernels are matmul time, flash/flex kernels
    attention, the rest other; the top ops are the aten ops' own GPU time."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from draftsmith.train.bench_profile import summarize

    def kernel(name, us):
        return SimpleNamespace(key=name, device_type=DeviceType.CUDA, self_device_time_total=us,
                               self_cpu_time_total=0.0)  # fmt: skip

    def op(name, us):
        return SimpleNamespace(key=name, device_type=DeviceType.CPU, self_device_time_total=us,
                               self_cpu_time_total=5.0)  # fmt: skip

    events = [
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", 300.0),
        kernel("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN", 100.0),
        kernel("triton_tem_fused_flex_attention_0", 200.0),
        kernel("void at::native::elementwise_kernel<128, 4>", 400.0),
        op("aten::mm", 400.0),
        op("aten::copy_", 350.0),
        op("aten::mul", 50.0),
    ]
    s = summarize(events, steps=2, wall_s=0.002, device="cuda")
    assert s["clock"] == "gpu kernels"
    assert s["matmul_share"] == pytest.approx(0.4) and s["attention_share"] == pytest.approx(0.2)
    assert s["other_share"] == pytest.approx(0.4) and s["busy"] == pytest.approx(0.5)
    top = [(o["op"], o["share"], o["ms_per_step"]) for o in s["top_ops"]]
    assert top == [("aten::mm", 0.5, 0.2), ("aten::copy_", 0.4375, 0.175),
                   ("aten::mul", 0.0625, 0.025)]  # fmt: skip
