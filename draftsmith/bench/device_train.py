"""The real training loop on a device against the same loop on the CPU (``tools/device_train.sh``).

``build`` makes, from a seed and nothing else (the device has no vLLM, no registry and no
SmolLM2), a tiny random Llama target and a dataset of it: random prompts answered greedily
by transformers, the states of the tapped layers written as ``draftsmith extract`` writes
them (``shards.write_shard``: bf16, per-sample checksums). ``compare`` reads the runs the
script made (``draftsmith train fit`` on the CPU; on CUDA with ``auto`` levers, uninterrupted
and cut then resumed from its checkpoint; ``draftsmith export`` of each) and checks:

- the CUDA loss curve against the CPU one, step for step: the first step within
  ``FIRST_STEP_RTOL`` (same weights, same batch: only the kernels differ), every step within
  ``CURVE_RTOL`` (then the runs drift apart as any two float orders do);
- the resumed CUDA run against the uninterrupted one: the last loss within ``RESUME_RTOL``;
- the exported heads: the same files, tensor names, shapes and dtypes everywhere; the
  CUDA run's head exported on the CPU bit for bit the one exported with CUDA present; the
  CUDA and CPU heads within ``HEAD_RTOL`` relative norm per tensor.

    python -m draftsmith.bench.device_train build --out DIR
    python -m draftsmith.bench.device_train compare --out DIR     # exit 1 when out of bounds
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import torch

FIRST_STEP_RTOL = 2e-3
CURVE_RTOL = 0.05
RESUME_RTOL = 1e-2
HEAD_RTOL = 0.15
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
            vocab_size=2048, tie_word_embeddings=False)  # fmt: skip
LAYER_IDS = [2, 4, 5, 8]


def build(out: Path, samples: int = 64, seed: int = 0) -> None:
    """``out/target`` (config.json + weights) and ``out/data`` (a complete dataset)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftsmith.core.files import write_json_atomic
    from draftsmith.core.targets import read_target
    from draftsmith.dataset.manifest import target_entry
    from draftsmith.dataset.shards import bytes_per_token, write_shard
    from draftsmith.extract.verify import reference_states

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY, bos_token_id=1, eos_token_id=2)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)  # peaked next-token distributions, as the tests' targets
    model.save_pretrained(out / "target", safe_serialization=True)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(samples):
        prompt = torch.randint(3, TINY["vocab_size"], (int(torch.randint(8, 24, (1,),
                               generator=gen)),), generator=gen)  # fmt: skip
        with torch.no_grad():
            ids = model.generate(prompt[None], max_new_tokens=56, do_sample=False,
                                 pad_token_id=0)[0]  # fmt: skip
        rows.append({"id": f"s{i}", "input_ids": ids,
                     "loss_mask": torch.arange(len(ids)) >= len(prompt),
                     "hidden_states": reference_states(model, ids, LAYER_IDS)})  # fmt: skip
    data = out / "data"
    data.mkdir(parents=True)
    shards = [write_shard(data / f"shard-{k // 16:05d}.safetensors", rows[k : k + 16], "bfloat16")
              for k in range(0, samples, 16)]  # fmt: skip
    target = read_target(str(out / "target"))
    write_json_atomic(data / "manifest.json", {
        "format": "draftsmith.hidden_states", "format_version": 1, "complete": True,
        "target": target_entry(target), "tokenizer": {"path": target.path, "sha256": None},
        "layer_ids": LAYER_IDS, "hidden_size": target.hidden_size, "storage_dtype": "bfloat16",
        "bytes_per_token": bytes_per_token(len(LAYER_IDS), target.hidden_size, "bfloat16"),
        "num_shards_planned": len(shards), "num_samples": samples,
        "num_tokens": sum(len(r["input_ids"]) for r in rows),
        "shards": [s.to_dict() for s in shards],
    })  # fmt: skip
    print(f"device_train: {out}: target (8 layers, hidden 128, vocab 2048), {samples} samples")


def losses(run: Path) -> dict[int, float]:
    """step -> train/loss from a run's CSVLogger files (every version: a resumed run adds one)."""
    out: dict[int, float] = {}
    for path in sorted(run.glob("**/metrics.csv")):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get("train/loss"):
                    out[int(row["step"])] = float(row["train/loss"])
    return out


def head_tensors(head: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(head.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def compare(out: Path) -> dict:
    cpu, cuda, resumed = (losses(out / n) for n in ("cpu", "cuda", "cuda-resumed"))
    report: dict = {"steps": {"cpu": len(cpu), "cuda": len(cuda), "cuda_resumed": len(resumed)}}
    checks: dict[str, bool] = {}
    common = sorted(set(cpu) & set(cuda))
    if common:
        diffs = {s: abs(cuda[s] - cpu[s]) / abs(cpu[s]) for s in common}
        report["curve"] = {"first_step_rtol": diffs[common[0]], "max_rtol": max(diffs.values()),
                           "cpu_last": cpu[common[-1]], "cuda_last": cuda[common[-1]]}  # fmt: skip
        checks["first step"] = diffs[common[0]] <= FIRST_STEP_RTOL
        checks["curve"] = max(diffs.values()) <= CURVE_RTOL
    if resumed and cuda:
        last = max(set(resumed) & set(cuda), default=None)
        if last is not None:
            d = abs(resumed[last] - cuda[last]) / abs(cuda[last])
            report["resume"] = {"step": last, "rtol": d}
            checks["resume"] = d <= RESUME_RTOL
    heads = {n: out / f"head-{n}" for n in ("cpu", "cuda", "cuda-on-cpu")}
    if all((h / "config.json").is_file() for h in heads.values()):
        t = {n: head_tensors(h) for n, h in heads.items()}
        files = {n: sorted(p.name for p in h.iterdir()) for n, h in heads.items()}
        same = all(files[n] == files["cpu"] for n in files) and all(
            {k: (v.shape, v.dtype) for k, v in t[n].items()}
            == {k: (v.shape, v.dtype) for k, v in t["cpu"].items()} for n in t
        )  # fmt: skip
        checks["head files, names, shapes, dtypes"] = same
        checks["export on CPU = export with CUDA"] = same and all(
            torch.equal(t["cuda"][k], t["cuda-on-cpu"][k]) for k in t["cuda"]
        )
        if same:
            per = {
                k: rel(t["cuda"][k], t["cpu"][k])
                for k in t["cpu"]
                if t["cpu"][k].is_floating_point()
            }
            report["head_rtol"] = per
            checks["head close"] = max(per.values(), default=0.0) <= HEAD_RTOL
    report["checks"] = checks
    report["ok"] = bool(checks) and all(checks.values())
    return report


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftsmith.bench.device_train")
    parser.add_argument("what", choices=["build", "compare"])
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args(args)
    if a.what == "build":
        build(a.out)
        return 0
    report = compare(a.out)
    (a.out / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
