"""The CUDA attention paths of the TTT unroll: flex attention with a block mask
(``model.attention: flex``), compile per TTT setting (``model.compile``), and the casts
removed under bf16 autocast, checked against the reference paths at tiny shapes on CPU.

torch's flex attention runs its forward on CPU (eager: the unfused reference); its backward
is refused there. The gradient tests lift that refusal (``_validate_device``) so torch's own
CPU reference backward (``sdpa_dense_backward``) runs with our block mask: what they check
is the mask and the key layout, not the CUDA kernel, which the ``gpu`` test checks.
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex
from torch.utils._python_dispatch import TorchDispatchMode

from draftsmith.core.errors import ConfigError
from draftsmith.drafters.attention.layers import Attention, RotaryEmbedding
from draftsmith.drafters.attention.ttt import (
    dense_step_attention,
    document_causal_mask,
    efficient_step_attention,
    resolve_attention,
    ttt_unroll,
)
from draftsmith.drafters.attention.ttt_compile import (
    COMPILE_GAIN,
    compile_wins,
    compiled_unroll,
    use_compile,
)
from draftsmith.drafters.attention.ttt_flex import flex_step_attention, ttt_block_mask
from draftsmith.drafters.eagle1.head import Eagle1Head
from draftsmith.drafters.eagle3.head import Eagle3Head
from draftsmith.drafters.protocol.options import TTTOptions, field_docs

H, V = 64, 300
DIMS = dict(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128)


@pytest.fixture(autouse=True)
def quiet_flex():
    with warnings.catch_warnings():  # eager flex warns that it is unfused: that is the point
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


@pytest.fixture
def flex_cpu_backward(monkeypatch):
    """torch's reference flex backward on CPU (see the module docstring)."""
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *args: None)


def head_of(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "eagle3":
        head = Eagle3Head(**DIMS, vocab_size=V, draft_vocab_size=150, num_layers=2)
    else:
        head = Eagle1Head(**DIMS, vocab_size=V, num_layers=2)
    head.set_embeddings(torch.randn(V, H))
    return head


def packed(width: int, docs: list[list[int]]):
    """Rows packing documents of the given lengths (equal totals), positions per document."""
    torch.manual_seed(1)
    doc = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in docs])
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    b, t = doc.shape
    return torch.randint(1, V, (b, t)), torch.randn(b, t, width), pos, doc


ROWS = [[7, 8, 5, 4], [24], [3, 3, 3, 15]]  # several documents per row, one whole row


def unroll_with_grads(head, batch, steps: int, impl: str, unroll=ttt_unroll):
    ids, hs, pos, doc = batch
    hs = hs.clone().requires_grad_(True)
    head.zero_grad()
    states = unroll(head, ids, hs, pos, doc, steps, impl)
    weights = torch.randn(steps, *states[0].shape, generator=torch.Generator().manual_seed(2))
    weights = weights.to(states[0].device, states[0].dtype)
    sum((s * w).sum() for s, w in zip(states, weights, strict=True)).backward()
    grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    return [s.detach() for s in states], hs.grad, grads


def assert_same(a, b, **tol) -> None:
    (sa, ha, ga), (sb, hb, gb) = a, b
    for x, y in zip(sa, sb, strict=True):
        torch.testing.assert_close(x, y, **tol)
    torch.testing.assert_close(ha, hb, **tol)
    assert set(ga) == set(gb) and ga
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], msg=name, **tol)


def assert_close_in_norm(a, b, rel: float) -> None:
    """Every state, input gradient and parameter gradient within ``rel`` of the other's
    norm: bf16 rounds a summed weight gradient of 219 to steps of 1, so elementwise
    tolerances judge rounding, not the kernel (on an H200: flex and efficient both within
    0.6% of dense, 2026-11-27)."""
    (sa, ha, ga), (sb, hb, gb) = a, b
    assert set(ga) == set(gb) and ga
    pairs = [*zip(sa, sb, strict=True), (ha, hb), *((ga[n], gb[n]) for n in ga)]
    for i, (x, y) in enumerate(pairs):
        err = ((x.float() - y.float()).norm() / y.float().norm()).item()
        assert err <= rel, (i, err)


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_flex_forward_equals_sdpa_on_cpu(kind: str, steps: int) -> None:
    """The flex path's states equal the SDPA paths' (dense, efficient), packed documents in
    every row; torch runs flex's forward on CPU as it is."""
    head = head_of(kind)
    ids, hs, pos, doc = packed(3 * H if kind == "eagle3" else H, ROWS)
    with torch.no_grad():
        flex = ttt_unroll(head, ids, hs, pos, doc, steps, "flex")
        for impl in ("dense", "efficient"):
            for a, b in zip(flex, ttt_unroll(head, ids, hs, pos, doc, steps, impl), strict=True):
                torch.testing.assert_close(a, b)
    if steps > 1:  # the diagonal keys are in use
        assert not torch.allclose(flex[0], flex[1])


@pytest.mark.parametrize("steps", [1, 3])
def test_flex_gradients_equal_sdpa(steps: int, flex_cpu_backward) -> None:
    """Outputs and every gradient of a TTT unroll through flex equal the dense SDPA path's
    (float64: the two agree to rounding, tightly)."""
    head = head_of("eagle3").double()
    batch = tuple(x.double() if x.is_floating_point() else x for x in packed(3 * H, ROWS))
    assert_same(
        unroll_with_grads(head, batch, steps, "flex"),
        unroll_with_grads(head, batch, steps, "dense"),
    )


def test_block_mask_is_the_dense_ttt_mask() -> None:
    """flex's mask over (k+1)T keys is dense's: causal within documents, then diagonals."""
    doc = torch.tensor([[0] * 5 + [1] * 3 + [2] * 4])
    step = 2
    mask = ttt_block_mask(doc, step).to_dense()  # [B, 1, T/block, S/block]: one block here
    assert mask.shape[-1] == 1 and bool(mask.all())
    mod = torch_flex.create_mask(
        ttt_block_mask(doc, step).mask_mod, 1, 1, 12, 36, device="cpu"
    )  # [1, 1, T, 3T]
    prefix = document_causal_mask(doc)[0, 0]
    eye = torch.eye(12, dtype=torch.bool)
    assert torch.equal(mod[0, 0], torch.cat([prefix, eye, eye], dim=-1))


def test_flex_refuses_cpu_training_in_one_line() -> None:
    head = head_of("eagle3")
    ids, hs, pos, doc = packed(3 * H, ROWS)
    with pytest.raises(ConfigError, match=r"model.attention: 'flex' on cpu.*CUDA") as err:
        ttt_unroll(head, ids, hs.requires_grad_(True), pos, doc, 2, "flex")
    assert "\n" not in str(err.value)


def test_flex_step_with_gqa_equals_dense_step(flex_cpu_backward) -> None:
    """One step's attention, grouped kv heads (4 query heads read 2), several documents."""
    g = torch.Generator().manual_seed(0)
    doc = torch.tensor([[0] * 7 + [1] * 8 + [2] * 5, [3] * 20])
    q = torch.randn(2, 4, 20, 8, generator=g, requires_grad=True)
    kv = [torch.randn(2, 2, 20, 8, generator=g, requires_grad=True) for _ in range(6)]
    keys, values = kv[:3], kv[3:]
    out = flex_step_attention(q, keys, values, ttt_block_mask(doc, 2))
    ref = dense_step_attention(q, keys, values, document_causal_mask(doc))
    torch.testing.assert_close(out, ref)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), [q, *kv])
    want = torch.autograd.grad((ref * w).sum(), [q, *kv])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


class Casts(TorchDispatchMode):
    """Records (shape, from, to) of every dtype cast below autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[tuple[int, ...], torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype", args[0].dtype) != (
            args[0].dtype
        ):
            self.seen.append((tuple(args[0].shape), args[0].dtype, kwargs["dtype"]))
        return func(*args, **kwargs)


def test_efficient_merge_keeps_states_in_bf16() -> None:
    """The log-sum-exp merge casts only [B, n, T] weights and scores, never a state."""
    g = torch.Generator().manual_seed(0)
    doc = torch.tensor([[0] * 7 + [1] * 9])
    q = torch.randn(1, 4, 16, 8, generator=g).bfloat16()
    kv = [torch.randn(1, 2, 16, 8, generator=g).bfloat16() for _ in range(6)]
    mask = document_causal_mask(doc)
    with Casts() as casts:
        out = efficient_step_attention(q, kv[:3], kv[3:], mask)
    assert out.dtype == torch.bfloat16
    assert casts.seen and all(len(shape) < 4 or shape[-1] != 8 for shape, *_ in casts.seen)
    ref = dense_step_attention(*(x.float() for x in (q,)), [k.float() for k in kv[:3]],
                               [v.float() for v in kv[3:]], mask)  # fmt: skip
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_rope_tables_cast_once_per_attention() -> None:
    """Attention under bf16 autocast casts the rotary tables once (cos, sin) for q and k,
    and rotating with them equals rotating each tensor on its own, bit for bit."""
    rope = RotaryEmbedding(32, 10000.0, None)
    attn = Attention(0, H, H, 4, 2, 32, bias=False)
    x, pos = torch.randn(2, 6, H), torch.arange(6).repeat(2, 1)
    with Casts() as casts, torch.autocast("cpu", dtype=torch.bfloat16):
        attn(x, pos, rope, lambda i, q, k, v: q)
    tables = [c for c in casts.seen if c[0] == (2, 6, 16)]
    assert [c[1:] for c in tables] == [(torch.float32, torch.bfloat16)] * 2
    q = torch.randn(2, 4, 6, 32)
    torch.testing.assert_close(rope(q, pos), rope.rotate(q, *rope.tables(pos, q.dtype)), rtol=0,
                               atol=0)  # fmt: skip


def test_eagle3_first_layer_reads_embeddings_in_the_state_dtype() -> None:
    """Under autocast the first layer's q/k/v read a bf16 input: no float32 concatenation
    (one upcast, then three downcasts of [B, T, 2H]); the states are unchanged."""
    head = head_of("eagle3")
    ids, hs, pos, doc = packed(3 * H, [[10, 14], [24]])
    with Casts() as casts, torch.autocast("cpu", dtype=torch.bfloat16):
        ttt_unroll(head, ids, hs, pos, doc, 2, "dense")
    wide = collections.Counter(c for c in casts.seen if c[0] == (2, 24, 2 * H))
    assert not wide, wide


def test_compile_choice_per_ttt_setting() -> None:
    assert COMPILE_GAIN[7] > COMPILE_GAIN[3] > 0  # as measured on 2026-11-27 (H200)
    assert compile_wins(7) and compile_wins(10) and compile_wins(1)
    assert not compile_wins(5, {3: -0.4, 7: 0.1})  # a tie goes to the smaller measured setting
    assert compile_wins(4, {2: -0.1, 4: 0.2})
    assert use_compile("auto", 7, "cuda") and use_compile("auto", 3, "cuda")
    assert not use_compile("auto", 7, "cpu")  # CPU: today's eager path
    assert not use_compile("auto", 7, "cuda", world_size=8)  # several processes: not measured
    assert use_compile("on", 3, "cpu") and not use_compile("off", 7, "cuda")
    with pytest.raises(ValueError, match="compile"):
        use_compile("yes", 7, "cuda")  # type: ignore[arg-type]
    assert TTTOptions().compile == "auto" and TTTOptions(attention="flex").attention == "flex"
    docs = field_docs(TTTOptions)
    assert "flex" in docs["attention"] and "2026-11-27" in docs["compile"]


def test_auto_attention_follows_the_device_and_compile() -> None:
    assert resolve_attention("auto", "cpu", compiled=False) == "blockwise"
    assert resolve_attention("auto", "cpu", compiled=True) == "blockwise"
    assert resolve_attention("auto", "cuda", compiled=True) == "flex"
    assert resolve_attention("auto", "cuda", compiled=False) == "efficient"
    assert resolve_attention("dense", "cuda", compiled=True) == "dense"


def test_compiled_unroll_equals_eager() -> None:
    """The unroll traced by torch.compile (aot_eager: dynamo and AOTAutograd, no codegen on
    this CPU) gives the eager unroll's states and gradients."""
    torch._dynamo.reset()
    head = head_of("eagle3")
    batch = packed(3 * H, [[7, 8, 5, 4], [24]])
    compiled = compiled_unroll("aot_eager")
    got = unroll_with_grads(head, batch, 3, "efficient", compiled)
    want = unroll_with_grads(head, batch, 3, "efficient")
    assert_same(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex's CUDA kernel needs a GPU")
@pytest.mark.parametrize("steps", [1, 3])
def test_flex_on_cuda_equals_dense(steps: int) -> None:
    """The compiled flex kernel and its backward on CUDA, bf16 autocast, against dense."""
    head = head_of("eagle3").cuda()
    batch = tuple(x.cuda() for x in packed(3 * H, ROWS))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = unroll_with_grads(head, batch, steps, "flex")
        want = unroll_with_grads(head, batch, steps, "dense")
    assert_close_in_norm(got, want, rel=1.5e-2)
