"""`draftsmith bench-gpu` on CPU at tiny shapes: every row, the MFU arithmetic by hand, the
profiles, the levers table (on CPU the CUDA levers refuse or skip with their reason), the
loader against the GPU rate, and the rows of a missing speculators; bench-train passing each
speed lever through to the step."""

from __future__ import annotations

import json

import pytest

from draftsmith.bench import gpu as bench_gpu
from draftsmith.bench import speculators as bench_speculators
from draftsmith.bench import train as bench
from draftsmith.bench.flops import StepFlops, peak_tflops
from draftsmith.core.errors import ConfigError
from draftsmith.drafters.losses.fused_loss import triton_missing

CPU_AUTO = {"fused_loss": False, "attention": "blockwise", "compile": False}

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
            "--levers=[old, fused, flex, compile, all, auto]", "--levers_ttt_steps=[1, 2]",
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
        assert r["levers"] == CPU_AUTO  # auto on CPU: the torch loss, blockwise, eager
    for r in rows[8:]:
        assert r["status"].startswith("skipped: speculators is not installed"), r
        assert "tokens_per_s" not in r

    levers = result["levers"]
    names = ["old", "fused", "flex", "compile", "all", "auto"]
    assert [(r["config"], r["ttt"]) for r in levers] == [(n, k) for k in (1, 2) for n in names]
    for r in levers:
        assert (r["target"], r["lm_head"]) == (targets[0], "frozen")
        fused, attention, compile_ = bench_gpu.LEVERS[r["config"]]
        asked = {"fused_loss": fused, "attention": attention, "compile": compile_}
        assert r["options"] == asked
        status = r["status"]
        if r["config"] in ("old", "auto"):
            assert status == "ok" and r["tokens_per_s"] > 0 and r["profile"]["steps"] == 1
            assert r["x_old"] == pytest.approx(
                r["tokens_per_s"] / levers[0 if r["ttt"] == 1 else 6]["tokens_per_s"]
            )
        elif r["config"] in ("fused", "all"):  # refused before the head is built
            assert status.startswith("refused: model.fused_loss: 'on' needs CUDA tensors")
            assert r["levers"] is None and r["x_old"] is None
        elif r["config"] == "flex":  # torch has no flex backward on CPU: refused at its step
            assert status.startswith("refused: model.attention: 'flex' on cpu")
            assert r["levers"] == {**CPU_AUTO, "attention": "flex"}
        else:
            assert status == bench_gpu.COMPILE_ON_CPU
            assert r["levers"] == {**CPU_AUTO, "attention": "efficient", "compile": True}
        assert "\n" not in status
    old = [r for r in levers if r["config"] == "old"]
    assert all(r["levers"] == {**CPU_AUTO, "attention": "efficient"} for r in old)
    for r in (r for r in levers if r["config"] == "auto"):  # the main row's run, not another
        main = next(m for m in rows if (m["target"], m["ttt"], m["lm_head"]) ==
                    (targets[0], r["ttt"], "frozen"))  # fmt: skip
        assert r["same_run_as"] == "the main row" and r["levers"] == CPU_AUTO
        assert r["tokens_per_s"] == main["tokens_per_s"]

    loader = result["loader"]
    assert loader["config"]["order"] == "shards"
    assert [(p["workers"], p["tokens"]) for p in loader["passes"]] == [(0, 200), (2, 200)]
    base = rows[0]  # the first target's frozen head at the smallest TTT
    assert loader["gpu_ttt"] == 1 and loader["gpu_tokens_per_s"] == base["tokens_per_s"]
    for p in loader["passes"]:
        assert p["x_gpu"] == pytest.approx(p["tokens_per_s"] / base["tokens_per_s"])
        assert p["x_raw"] > 0
    # the same step with the loader in front, per worker count, beside the step-only rate
    e2e = result["end_to_end"]
    assert [(r["workers"], r["ttt"], r["lm_head"], r["status"]) for r in e2e] == [
        (0, 1, "frozen", "ok"), (2, 1, "frozen", "ok")]  # fmt: skip
    for r in e2e:
        assert r["step_only_tokens_per_s"] == base["tokens_per_s"] and r["real_tokens_per_s"] > 0
        assert r["x_step"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"])
    assert not any((tmp_path / "work").iterdir())  # the kept shards went after

    page = (out / "bench-gpu.md").read_text()
    assert page.startswith("# bench-gpu: cpu") and page in capsys.readouterr().out
    table = [line for line in page.splitlines() if line.startswith("| draftsmith")]
    assert len(table) == 8 and all("%" in line for line in table)
    assert page.count("| speculators, ") == 4
    assert page.count("skipped: speculators is not installed") == 4
    assert page.count("\n### draftsmith, ") == 8  # one profile per draftsmith row
    assert "## Loader (shard order" in page and "| 2 | cold | 200 |" in page
    assert "## End to end: the step with the loader in front" in page
    assert all("| torch loss, blockwise, eager |" in line for line in table)
    lever_lines = page.split("## Speed levers (")[1].split("\n## ")[0].splitlines()
    lever_lines = [line for line in lever_lines if line.startswith("| ") and "TTT" not in line]
    assert [line.split(" | ")[0] for line in lever_lines] == [
        f"| {n}" + (" (main row)" if n == "auto" else "") for k in (1, 2) for n in names
    ]
    assert page.count("| refused: model.fused_loss: 'on' needs CUDA") == 4
    old_lines = [line for line in lever_lines if line.startswith("| old |")]
    assert len(old_lines) == 2 and all("| 1.00x |" in line for line in old_lines)  # old vs itself


def test_a_failing_row_is_recorded_and_every_row_saved(tmp_path, monkeypatch, tiny_model_dir):
    real = bench_gpu.draftsmith_row

    def flaky(cfg, target, ttt, lm_head, peak):
        if lm_head == "trained":
            raise RuntimeError("CUDA out of memory (planted)")
        return real(cfg, target, ttt, lm_head, peak)

    real_lever = bench_gpu.lever_row

    def flex_fails(cfg, name, target, ttt, peak):  # as a flex compile error on the device
        if name == "flex":
            raise RuntimeError("InductorError: flex backward lowering failed (planted)\nmore")
        return real_lever(cfg, name, target, ttt, peak)

    monkeypatch.setattr(bench_gpu, "draftsmith_row", flaky)
    monkeypatch.setattr(bench_gpu, "lever_row", flex_fails)
    cfg = bench_gpu.BenchGpuConfig(targets=[str(tiny_model_dir)], ttt_steps=[1], row_tokens=32,
                                   draft_vocab_size=64, steps=1, profile_steps=0,
                                   speculators=False, loader=False, levers=["flex", "old"],
                                   levers_ttt_steps=[1])  # fmt: skip
    saved: list[int] = []  # rows written out so far, after each row
    result = bench_gpu.run(cfg, save=lambda r: saved.append(len(r["rows"]) + len(r["levers"])))
    assert saved == [1, 2, 3, 4]
    rows = result["rows"]
    failed = "failed: RuntimeError: CUDA out of memory (planted)"
    assert [r["status"] for r in rows] == ["ok", failed]
    assert "profile" not in rows[0] and rows[0]["mfu_6nt"] is None  # no peak known on CPU
    flex, old = result["levers"]
    assert flex["status"] == "failed: RuntimeError: InductorError: flex backward lowering " \
        "failed (planted)"  # fmt: skip
    assert old["status"] == "ok" and old["x_old"] == 1.0 and flex["x_old"] is None


def test_auto_that_resolves_as_all_is_not_run_twice(monkeypatch, tiny_model_dir):
    """On a device where auto picks every lever, its row says so instead of running again."""
    every = {"fused_loss": True, "attention": "flex", "compile": True}
    monkeypatch.setattr(bench_gpu, "resolve_levers", lambda bcfg, device: every)
    cfg = bench_gpu.BenchGpuConfig(targets=[str(tiny_model_dir)], attention="efficient",
                                   levers=["all", "auto"])  # fmt: skip
    row = bench_gpu.auto_shortcut(cfg, str(tiny_model_dir), 7, rows=[])
    assert row == {"status": "skipped: auto resolves to the levers of 'all' here"}
    cfg.levers = ["old", "auto"]  # no 'all' row to stand for it: auto runs
    assert bench_gpu.auto_shortcut(cfg, str(tiny_model_dir), 7, rows=[]) is None


def test_bench_train_passes_every_lever_to_the_step(monkeypatch, tiny_model_dir):
    """fused_loss reaches ttt_loss, attention the unroll, compile picks the compiled unroll
    (a stand-in here: compiling on CPU takes minutes), and bench-train reports them."""
    calls: dict[str, object] = {}
    real_unroll, real_loss = bench.ttt_unroll, bench.ttt_loss

    def compiled(*args):
        calls["unroll"] = args[-1]  # the attention path
        return real_unroll(*args)

    def loss(*args, **kwargs):
        calls["fused"] = kwargs["fused"]
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(bench, "compiled_unroll", lambda: compiled)
    monkeypatch.setattr(bench, "ttt_loss", loss)
    tiny = dict(model=str(tiny_model_dir), ttt_steps=2, row_tokens=16, draft_vocab_size=64,
                random_weights=True)  # fmt: skip
    cfg = bench.BenchTrainConfig(**tiny, fused_loss="off", attention="efficient", compile="on")
    prepared = bench.prepare(cfg)
    prepared.step()
    assert calls == {"unroll": "efficient", "fused": "off"}
    assert prepared.levers == {"fused_loss": False, "attention": "efficient", "compile": True}

    calls.clear()
    auto = bench.prepare(bench.BenchTrainConfig(**tiny))
    auto.step()  # auto on CPU: the eager unroll, the torch loss, blockwise attention
    assert calls == {"fused": "off"} and auto.levers == CPU_AUTO
    with pytest.raises(ConfigError, match="model.fused_loss: 'on' needs CUDA"):
        bench.prepare(bench.BenchTrainConfig(**tiny, fused_loss="on"))


def test_auto_levers_on_a_gpu_by_ttt():
    """What the main rows' auto resolves to on a one-GPU device (from ttt_compile's table:
    every lever since the H200 run of 2026-11-27), and with compile off."""
    fused = triton_missing() is None  # the device image has Triton
    for ttt in (3, 7):
        levers = bench.resolve_levers(bench.BenchTrainConfig(ttt_steps=ttt), "cuda")
        assert levers == {"fused_loss": fused, "attention": "flex", "compile": True}
        eager = bench.resolve_levers(bench.BenchTrainConfig(ttt_steps=ttt, compile="off"), "cuda")
        assert eager == {"fused_loss": fused, "attention": "efficient", "compile": False}


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

    from draftsmith.bench.profile import summarize

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
