#!/usr/bin/env bash
# CPU training unchanged, tensor for tensor (docs/benchmarks.md, "The data path on this CPU"):
# the tiny random target's dataset (python -m draftsmith.bench.device_train build), its fp8
# copy (recode), then `train fit --config configs/train/tiny.yaml` (24 steps) and `export`
# with the code at BASE (git archive, not a worktree) and with this tree, on the same data:
# bf16 with 0 workers; bf16, 2 workers, shard order; fp8, 2 workers. Each pair of exported
# heads and final checkpoints must be equal bit for bit; exit 1 otherwise.
#
#   bash tools/same_head.sh 7905286          # BASE: the commit before the loader changes
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:?give the commit to compare against}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
W=${WORK:-/tmp/same-head}
HERE=$PWD
rm -rf "$W" && mkdir -p "$W/base"
git archive "$BASE" | tar -x -C "$W/base"
export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=
PYTHONPATH=$HERE "$PY" -m draftsmith.bench.device_train build --out "$W" >/dev/null
PYTHONPATH=$HERE "$PY" -m draftsmith.dataset.recode --src "$W/data" --dst "$W/data-fp8" \
    --dtype fp8_e4m3 >/dev/null
train() {  # train TREE NAME DATA [options]
    local tree=$1 name=$2 data=$3
    shift 3
    (cd "$tree" && PYTHONPATH=$tree "$PY" -m draftsmith.cli train fit \
        --config configs/train/tiny.yaml --data.data "$data" --trainer.max_steps 24 \
        --trainer.max_epochs -1 --trainer.default_root_dir "$W/$name" \
        --checkpoint.dirpath "$W/$name/ck" "$@" &&
        PYTHONPATH=$tree "$PY" -m draftsmith.cli export --checkpoint "$W/$name/ck/last.ckpt" \
            --output "$W/$name/head") >"$W/$name.log" 2>&1
}
for tree in base here; do
    dir=$W/base
    [ $tree = here ] && dir=$HERE
    train "$dir" "$tree-w0" "$W/data"
    train "$dir" "$tree-w2-shards" "$W/data" --data.num_workers 2 --data.order shards
    train "$dir" "$tree-fp8-w2" "$W/data-fp8" --data.num_workers 2
done
"$PY" - "$W" <<'PYEOF'
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

w, bad = Path(sys.argv[1]), 0
for run in ("w0", "w2-shards", "fp8-w2"):
    heads = [{k: v for f in sorted((w / f"{t}-{run}" / "head").glob("*.safetensors"))
              for k, v in load_file(f).items()} for t in ("base", "here")]
    cks = [torch.load(w / f"{t}-{run}" / "ck" / "last.ckpt", map_location="cpu",
                      weights_only=False)["state_dict"] for t in ("base", "here")]
    same_head = heads[0].keys() == heads[1].keys() and all(
        heads[0][k].dtype == heads[1][k].dtype and torch.equal(heads[0][k], heads[1][k])
        for k in heads[0])
    same_ck = cks[0].keys() == cks[1].keys() and all(torch.equal(cks[0][k], cks[1][k])
                                                     for k in cks[0])
    bad += not (same_head and same_ck)
    n = sum(v.numel() for v in heads[0].values())
    print(f"same_head {run}: {len(heads[0])} tensors, {n:,} values; head equal {same_head}, "
          f"checkpoint equal {same_ck}")
sys.exit(1 if bad else 0)
PYEOF
