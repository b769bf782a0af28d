"""Draft heads: shapes, vLLM checkpoint keys, and numerical agreement with vLLM's own modules."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftsmith.core.errors import ConfigError
from draftsmith.drafters import from_target_config, head_config
from draftsmith.drafters.attention.layers import RMSNorm, RotaryEmbedding, rope_inv_freq
from draftsmith.drafters.attention.ttt import ttt_unroll
from draftsmith.drafters.eagle1.head import Eagle1Head
from draftsmith.drafters.eagle3.head import Eagle3Head

TARGET = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 384,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"},
}
LAYER = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]
# The keys of the notes' "Serving a head" section (no `model.` prefix).
EAGLE3_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "midlayer.hidden_norm.weight"}
EAGLE3_KEYS |= {f"midlayer.{k}" for k in LAYER}
VLLM = (
    Path(importlib.util.find_spec("vllm").origin).parent
    if importlib.util.find_spec("vllm")
    else None
)


def eagle3(**kw) -> Eagle3Head:
    torch.manual_seed(0)
    head = from_target_config(TARGET, **{"draft_vocab_size": 200, **kw})
    assert isinstance(head, Eagle3Head)
    head.set_embeddings(torch.randn(384, 128))
    return head


def test_eagle3_state_dict_keys_and_shapes() -> None:
    sd = eagle3().state_dict()
    assert set(sd) == EAGLE3_KEYS
    assert sd["fc.weight"].shape == (128, 3 * 128)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (2 * 64, 2 * 128)  # input width 2H
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (64, 2 * 128)
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (128, 2 * 64)
    assert sd["lm_head.weight"].shape == (200, 128)
    assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (200,)
    # Later layers are plain Llama layers named `layers.{i}`, input width H.
    sd2 = eagle3(num_layers=3).state_dict()
    extra = {f"layers.{i}.{k}" for i in (1, 2) for k in LAYER}
    assert set(sd2) == EAGLE3_KEYS | extra
    assert sd2["layers.2.self_attn.q_proj.weight"].shape == (128, 128)
    # A full-vocabulary head ships no d2t (vLLM refuses to load one).
    assert set(eagle3(draft_vocab_size=None).state_dict()) == EAGLE3_KEYS - {"d2t"}


def test_eagle1_state_dict_keys() -> None:
    head = from_target_config(TARGET, kind="eagle", num_layers=2)
    assert isinstance(head, Eagle1Head)
    keys = {"fc.weight"} | {f"layers.{i}.{k}" for i in (0, 1) for k in LAYER}
    assert set(head.state_dict()) == keys - {"layers.0.input_layernorm.weight"}
    assert head.state_dict()["fc.weight"].shape == (128, 256)


def test_forward_shapes() -> None:
    head = eagle3(num_layers=2)
    ids, pos = torch.randint(0, 384, (2, 9)), torch.arange(9).expand(2, 9)
    hidden = head.combine_hidden_states(torch.randn(2, 9, 384))
    normed, feedback = head(ids, hidden, pos)
    assert hidden.shape == normed.shape == feedback.shape == (2, 9, 128)
    assert not torch.allclose(normed, feedback)  # feedback is the pre-norm state
    assert head.lm_head(normed).shape == (2, 9, 200)
    e1 = from_target_config(TARGET, kind="eagle")
    out, fb = e1(ids, torch.randn(2, 9, 128), pos)
    assert out.shape == (2, 9, 128) and out is fb


def test_options_change_the_computation() -> None:
    ids, pos = torch.randint(0, 384, (1, 7)), torch.arange(7)[None]
    base = eagle3()
    hidden = torch.randn(1, 7, 128)
    ref = base(ids, hidden, pos)
    other = eagle3(norm_before_residual=True)
    assert not torch.allclose(other(ids, hidden, pos)[1], ref[1])
    normed_out = eagle3(norm_output=True)(ids, hidden, pos)
    assert torch.equal(normed_out[0], normed_out[1]) and torch.allclose(normed_out[0], ref[0])
    base.set_embeddings(torch.randn(384, 128))  # embeddings matter and are never exported
    assert not torch.allclose(base(ids, hidden, pos)[0], ref[0])
    assert "embed_tokens" not in "".join(base.state_dict())


def test_norms_before_fc() -> None:
    """norm_before_fc: one RMSNorm over the fused states; fc_norm: one per tapped state,
    applied after it (vLLM's combine_hidden_states); both off by default."""
    head = eagle3(norm_before_fc=True, fc_norm=True)
    sd = head.state_dict()
    extra = {"input_norm.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
    assert set(sd) == EAGLE3_KEYS | extra
    assert sd["input_norm.weight"].shape == (3 * 128,) and sd["fc_norm.2.weight"].shape == (128,)
    for p in (head.input_norm.weight, *(n.weight for n in head.fc_norm)):
        p.data.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 3 * 128) * torch.tensor([1.0, 10.0, 100.0]).repeat_interleave(128)

    def rms(v, w):
        return v * v.pow(2).mean(-1, keepdim=True).add(1e-5).rsqrt() * w

    fused = rms(x, head.input_norm.weight)
    chunks = [rms(c, n.weight) for c, n in zip(fused.chunk(3, -1), head.fc_norm, strict=True)]
    expected = head.fc(torch.cat(chunks, -1))
    torch.testing.assert_close(head.combine_hidden_states(x), expected)
    only_fc_norm = eagle3(fc_norm=True)
    assert set(only_fc_norm.state_dict()) == EAGLE3_KEYS | extra - {"input_norm.weight"}
    assert eagle3().input_norm is None and eagle3().fc_norm is None


def test_rmsnorm_fused_add() -> None:
    norm = RMSNorm(16, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    normed, summed = norm(x, r)
    assert torch.allclose(summed, x + r)
    expected = (x + r) / (x + r).pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * norm.weight
    assert torch.allclose(normed, expected, atol=1e-6) and torch.allclose(norm(x + r), normed)


def test_draft_vocab_mapping() -> None:
    head = eagle3()
    ids = torch.randperm(384)[:200]
    head.set_draft_vocab(ids)
    draft = torch.arange(200)
    assert torch.equal(head.draft_to_target(draft), ids)
    assert torch.equal(draft + head.d2t[draft], ids)  # vLLM's rule: target = draft + d2t
    index = head.target_to_draft_index()
    assert torch.equal(index[ids], draft) and int((index >= 0).sum()) == 200
    assert int(head.t2d.sum()) == 200 and bool(head.t2d[ids].all())
    with pytest.raises(ValueError):
        head.set_draft_vocab(torch.zeros(200, dtype=torch.long))


def test_target_config_rope_and_errors() -> None:
    head = eagle3()
    assert head.rotary.inv_freq[1].item() == pytest.approx(50000.0 ** (-2 / 64))
    assert head.head_dim == 64 and head.midlayer.self_attn.num_kv_heads == 1
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    llama3 |= {"original_max_position_embeddings": 64, "rope_type": "llama3"}
    old_style = {k: v for k, v in TARGET.items() if k != "rope_parameters"}
    old_style |= {"rope_theta": 50000.0, "rope_scaling": llama3}
    h3 = from_target_config(old_style)
    assert torch.allclose(h3.rotary.inv_freq, rope_inv_freq(64, 50000.0, llama3))
    assert not torch.allclose(h3.rotary.inv_freq, head.rotary.inv_freq)
    gelu = from_target_config({**TARGET, "hidden_act": "gelu"})  # the head's MLP is its own
    assert gelu.midlayer.mlp.gate_proj.weight.shape == head.midlayer.mlp.gate_proj.weight.shape
    with pytest.raises(ConfigError, match="proportional"):  # every kind: tests/test_rope.py
        RotaryEmbedding(64, 1e4, {"rope_type": "proportional"})


# Runs in a subprocess (vLLM keeps global distributed state). Builds vLLM's own
# Eagle3LlamaForCausalLM / EagleLlamaForCausalLM from head directories (no engine), loads
# our checkpoints with vLLM's load_weights, and replays the proposer's loop
# (llm_base_proposer.propose) with an attention stub that behaves like one request's paged
# draft KV cache: each call writes k/v at its positions, queries see cached positions <= own.
VLLM_SCRIPT = r"""
import sys, torch, torch.nn.functional as F
from pathlib import Path
from vllm.engine.arg_utils import EngineArgs
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.layers.rotary_embedding import get_rope
work = Path(sys.argv[1]); job = torch.load(work / "job.pt"); out = {}
POS = {}

class CacheAttention(torch.nn.Module):
    def __init__(self, nh, nkv, hd):
        super().__init__(); self.nh, self.nkv, self.hd, self.cache = nh, nkv, hd, {}
    def forward(self, q, k, v):
        pos = POS["now"]
        for i, p in enumerate(pos.tolist()):
            self.cache[p] = (k[i], v[i])
        keys = sorted(self.cache)
        kk = torch.stack([self.cache[p][0] for p in keys]).view(len(keys), self.nkv, self.hd)
        vv = torch.stack([self.cache[p][1] for p in keys]).view(len(keys), self.nkv, self.hd)
        rep = self.nh // self.nkv
        kk, vv = (x.transpose(0, 1).repeat_interleave(rep, 0) for x in (kk, vv))
        qq = q.view(len(pos), self.nh, self.hd).transpose(0, 1)
        mask = torch.tensor(keys)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask)
        return o.transpose(0, 1).reshape(len(pos), -1)

def build(method, head_dir):
    spec = {"method": method, "model": str(head_dir), "num_speculative_tokens": 3}
    args = EngineArgs(model=str(work / "target"), skip_tokenizer_init=True, dtype="float32",
                      enforce_eager=True, max_model_len=512, speculative_config=spec)
    return args.create_engine_config()

def run(vc, cls, weights, eagle3):
    with set_current_vllm_config(vc):
        if not POS.get("dist"):
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                distributed_init_method="tcp://127.0.0.1:" + sys.argv[2], backend="gloo")
            initialize_model_parallel(1, 1); POS["dist"] = True
        m = cls(vllm_config=vc)
        names = [n for n, _ in m.named_parameters()]
        m.load_weights(iter(weights.items()))
        draft_config = vc.speculative_config.draft_model_config
        process_weights_after_loading(m, draft_config, torch.device("cpu"))
        stubs = []
        for layer in m.model.layers:
            a = layer.self_attn
            layer.self_attn.attn = CacheAttention(a.num_heads, a.num_kv_heads, a.head_dim)
            stubs.append(layer.self_attn.attn)
        ids, pos, K = job["ids"], job["pos"], job["K"]
        hs = job["aux"] if eagle3 else job["final"]
        res = {}
        with torch.no_grad():
            for t in range(len(ids) - K):
                for s in stubs: s.cache = {}
                h = m.combine_hidden_states(hs[: t + 1]) if eagle3 else hs[: t + 1]
                POS["now"] = pos[: t + 1]
                normed, aux = m(ids[1 : t + 2], pos[: t + 1], h)  # first pass: ids shifted
                res[(t, 0)] = normed[-1]
                h, p = aux[-1:], pos[t : t + 1].clone()
                for k in range(1, K):
                    p = p + 1; POS["now"] = p
                    normed, aux = m(ids[t + k + 1 : t + k + 2], p, h)
                    res[(t, k)] = normed[0]; h = aux
            logits = m.compute_logits(normed) if eagle3 else None
        return names, res, logits, normed

from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
vc = build("eagle3", work / "head3")
w3 = dict(torch.load(work / "head3.pt")); w3["embed_tokens.weight"] = job["embed"]
out["e3"] = run(vc, Eagle3LlamaForCausalLM, w3, True)
vcn = build("eagle3", work / "head3n")  # config.json as draftsmith exports it
wn = dict(torch.load(work / "head3n.pt")); wn["embed_tokens.weight"] = job["embed"]
out["e3n"] = run(vcn, Eagle3LlamaForCausalLM, wn, True)
with set_current_vllm_config(vc):
    ropes = []
    for params in job["ropes"]:
        r = get_rope(64, max_position=4096, is_neox_style=True, rope_parameters=params,
                     dtype=torch.float32)
        q, k = r.forward_native(job["rope_pos"], job["rope_q"], job["rope_k"])
        ropes.append(q)
    out["ropes"] = ropes
vc1 = build("eagle", work / "head1")
w1 = dict(torch.load(work / "head1.pt")); w1["embed_tokens.weight"] = job["embed"]
out["e1"] = run(vc1, EagleLlamaForCausalLM, w1, False)
torch.save(out, work / "vllm_out.pt")
"""


def vllm_to_checkpoint(name: str, eagle3: bool) -> set[str]:
    """Invert vLLM's load mapping for one parameter name; shared/unused ones map to nothing."""
    name = name.removeprefix("model.").replace("draft_id_to_target_id", "d2t")
    if eagle3:
        name = name.replace("layers.0.", "midlayer.")
    if name.startswith("embed_tokens") or (name.startswith("layers.") and "hidden_norm" in name):
        return set()  # shared from the target / built by vLLM for layers >= 1 but never used
    stacked = {
        ".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
        ".gate_up_proj.": (".gate_proj.", ".up_proj."),
    }
    for fused, parts in stacked.items():
        if fused in name:
            return {name.replace(fused, part) for part in parts}
    return {name}


def _write_head(path: Path, state: dict, config: dict) -> None:
    from safetensors.torch import save_file

    path.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.skipif(VLLM is None, reason="vllm not installed")
def test_matches_vllm_modules_and_proposer_loop(tmp_path: Path) -> None:
    """Our heads + TTT unroll == vLLM's model classes driven like the proposer, every stream."""
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(TARGET))
    torch.manual_seed(0)
    embed, n, k_steps = torch.randn(384, 128), 12, 3
    h3 = from_target_config(TARGET, draft_vocab_size=200, num_layers=2)
    h3.set_draft_vocab(torch.randperm(384)[:200])
    h3n = from_target_config(
        TARGET, draft_vocab_size=200, num_layers=2, norm_before_fc=True, fc_norm=True
    )  # both norms before fc
    h3n.set_draft_vocab(torch.randperm(384)[:200])
    h1 = from_target_config(TARGET, kind="eagle", num_layers=2)
    for h in (h3, h3n, h1):
        h.set_embeddings(embed)
        for p in h.parameters():  # non-trivial norms too
            p.data.add_(torch.randn_like(p) * 0.05)
    draft_cfg = {**TARGET, "num_hidden_layers": 2, "tie_word_embeddings": False}
    _write_head(
        tmp_path / "head3",
        h3.state_dict(),
        {
            **draft_cfg,
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": 200,
            "target_hidden_size": 128,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
        },
    )
    _write_head(
        tmp_path / "head1",
        h1.state_dict(),
        {**draft_cfg, "architectures": ["EagleLlamaForCausalLM"]},
    )
    verifier = str(tmp_path / "target")
    _write_head(
        tmp_path / "head3n",
        h3n.state_dict(),
        head_config(h3n, "eagle3", TARGET, [1, 2, 3], k_steps, verifier),
    )
    torch.save(h3.state_dict(), tmp_path / "head3.pt")
    torch.save(h3n.state_dict(), tmp_path / "head3n.pt")
    torch.save(h1.state_dict(), tmp_path / "head1.pt")
    llama3 = {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    llama3 |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    ropes = [{"rope_theta": 5e4, "rope_type": "default"}, llama3]
    ropes.append({"rope_theta": 1e4, "rope_type": "linear", "factor": 4.0})
    job = {
        "ids": torch.randint(0, 384, (n,)),
        "pos": torch.arange(n) + 3,
        "aux": torch.randn(n, 384),
        "final": torch.randn(n, 128),
        "embed": embed,
        "K": k_steps,
        "ropes": ropes,
        "rope_pos": torch.arange(40) * 37,
        "rope_q": torch.randn(40, 2 * 64),
        "rope_k": torch.randn(40, 64),
    }
    torch.save(job, tmp_path / "job.pt")
    port = str(29000 + (hash(str(tmp_path)) % 2000))
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, str(tmp_path), port],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(tmp_path / "vllm_out.pt", weights_only=False)

    heads = (("e3", h3, job["aux"]), ("e3n", h3n, job["aux"]), ("e1", h1, job["final"]))
    for key, head, hs in heads:
        names, res, logits, last = got[key]
        # vLLM's parameters, mapped back to checkpoint names, are exactly our state dict
        # (minus the shared embeddings and vLLM's unused hidden_norm of layers >= 1).
        mapped = set().union(*(vllm_to_checkpoint(name, key != "e1") for name in names))
        assert mapped == set(head.state_dict()), key
        with torch.no_grad():
            states = ttt_unroll(
                head, job["ids"][None], hs[None], job["pos"][None], torch.zeros(1, n), k_steps
            )
        for (t, k), ref in res.items():
            torch.testing.assert_close(
                states[k][0, t], ref, atol=2e-5, rtol=1e-4, msg=f"{key} stream {t} step {k}"
            )
    # Draft logits scattered to target ids as vLLM's compute_logits does.
    _, _, logits, last = got["e3"]
    full = torch.full((last.shape[0], 384), float("-inf"))
    full[:, h3.draft_to_target(torch.arange(200))] = h3.lm_head(last).detach()
    torch.testing.assert_close(full, logits, atol=1e-5, rtol=1e-5)
    for params, ref in zip(ropes, got["ropes"], strict=True):
        scaling = None if params["rope_type"] == "default" else params
        rope = RotaryEmbedding(64, params["rope_theta"], scaling)
        q = job["rope_q"].view(1, 40, 2, 64).transpose(1, 2)  # [1, n, T, hd]
        ours = rope(q, job["rope_pos"][None]).transpose(1, 2).reshape(40, -1)
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
