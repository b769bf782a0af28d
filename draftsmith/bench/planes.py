"""What lossless compression of bf16 states would save: zstd of the stored bytes, and of
their byte planes (docs/benchmarks.md, "Fewer bytes per token").

A bf16 value is two bytes: the high one holds the sign, the exponent and the top mantissa
bit (few distinct values in a layer's activations, so it compresses well), the low one the
rest of the mantissa (close to noise). Splitting a tensor's bytes into those two planes
before zstd lets the compressor see the redundant plane on its own. Both are lossless: a
head trains on exactly the values it would read from plain bf16, so the acceptance cost is
zero by construction and only bytes and decode speed are measured.

    python -m draftsmith.bench.planes --data outputs/acc/demo-bfloat16 [--levels 1 3]

Needs ``zstandard`` (``pip install zstandard``; not a dependency of draftsmith: nothing reads
compressed shards yet). Reads every shard's ``hidden_states`` (f32 sources are encoded to
bf16 first, as the extraction would have) and prints, per scheme and level: bytes per token
(states only, and of the whole sample), the ratio to plain bf16, and compress and decompress
MB/s of plain bf16 bytes on one core.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def planes(x: torch.Tensor) -> list[bytes]:
    """The high and low byte planes of a bf16 tensor (little-endian: byte 1 is the high)."""
    b = x.contiguous().view(torch.uint8).reshape(-1, 2)
    return [b[:, 1].contiguous().numpy().tobytes(), b[:, 0].contiguous().numpy().tobytes()]


def from_planes(hi: bytes, lo: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    """The bf16 tensor ``planes`` split (bit for bit)."""
    h = torch.frombuffer(bytearray(hi), dtype=torch.uint8)
    lo_t = torch.frombuffer(bytearray(lo), dtype=torch.uint8)
    return torch.stack([lo_t, h], dim=1).reshape(-1).view(torch.bfloat16).reshape(shape)


def bf16_states(data: Path) -> tuple[list[torch.Tensor], dict]:
    """Every shard's hidden_states as bf16 (as stored, or encoded from f32/f16), and the
    manifest."""
    from safetensors import safe_open

    manifest = json.loads((data / "manifest.json").read_text())
    if manifest["storage_dtype"] == "fp8_e4m3":
        raise SystemExit("planes: give a bf16, f16 or f32 dataset (fp8 has no bf16 planes)")
    out = []
    for shard in manifest["shards"]:
        with safe_open(str(data / shard["file"]), framework="pt") as f:
            out.append(f.get_tensor("hidden_states").to(torch.bfloat16))
    return out, manifest


def measure(tensors: list[torch.Tensor], levels: list[int]) -> list[dict]:
    import zstandard

    raw = sum(t.numel() * 2 for t in tensors)
    rows = []
    for level in levels:
        for scheme in ("bf16 bytes", "byte planes"):
            cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
            size, c_s, d_s = 0, 0.0, 0.0
            for t in tensors:
                parts = (
                    planes(t)
                    if scheme == "byte planes"
                    else [t.view(torch.uint8).numpy().tobytes()]
                )
                start = time.perf_counter()
                packed = [cctx.compress(p) for p in parts]
                c_s += time.perf_counter() - start
                start = time.perf_counter()
                back = [dctx.decompress(p) for p in packed]
                if scheme == "byte planes":
                    restored = from_planes(back[0], back[1], tuple(t.shape))
                else:
                    restored = torch.frombuffer(bytearray(back[0]), dtype=torch.bfloat16).view(
                        t.shape
                    )
                d_s += time.perf_counter() - start
                if not torch.equal(restored.view(torch.int16), t.view(torch.int16)):
                    raise AssertionError(f"{scheme} level {level}: not lossless")
                size += sum(len(p) for p in packed)
            rows.append({"scheme": scheme, "level": level, "bytes": size, "ratio": raw / size,
                         "compress_mb_s": raw / c_s / 1e6,
                         "decompress_mb_s": raw / d_s / 1e6})  # fmt: skip
    return rows


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftsmith.bench.planes")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--output", type=Path, default=None, help="JSON file for the figures")
    a = parser.parse_args(args)
    tensors, manifest = bf16_states(a.data)
    tokens = sum(t.shape[0] for t in tensors)
    raw = sum(t.numel() * 2 for t in tensors)
    other = 8 + 1  # input_ids (int64) and loss_mask (uint8) per token, stored as they are
    rows = measure(tensors, a.levels)
    shape = f"{tensors[0].shape[1]} layers x hidden {tensors[0].shape[2]}"
    print(f"planes: {a.data}: {tokens:,} tokens, {shape}; plain bf16 {raw / tokens:,.0f} "
          f"bytes/token of states (+{other} ids and mask)")  # fmt: skip
    print(
        "scheme        level  states B/tok  sample B/tok  x smaller  compress MB/s  decompress MB/s"
    )
    dash = f"{'1.00':>9}  {'-':>13}  {'-':>15}"
    print(f"plain bf16        -  {raw / tokens:12,.0f}  {raw / tokens + other:12,.0f}  {dash}")
    for r in rows:
        per = r["bytes"] / tokens
        print(f"{r['scheme']:<12} {r['level']:>6}  {per:12,.0f}  {per + other:12,.0f}  "
              f"{(raw + other * tokens) / (r['bytes'] + other * tokens):9.2f}  "
              f"{r['compress_mb_s']:13,.0f}  {r['decompress_mb_s']:15,.0f}")  # fmt: skip
    if a.output:
        result = {"data": str(a.data), "tokens": tokens, "layer_ids": manifest["layer_ids"],
                  "bf16_states_bytes_per_token": raw / tokens, "rows": rows}  # fmt: skip
        a.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
