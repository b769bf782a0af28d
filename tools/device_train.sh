#!/usr/bin/env bash
# The real training loop on CUDA against the CPU (docs/benchmarks.md, "The real loop on a
# device"): a tiny random Llama and a dataset of it built here from a seed
# (draftsmith/bench/device_train.py: transformers only, no vLLM), then `draftsmith train fit`
# (configs/train/tiny.yaml, 50 steps) on the CPU and, where CUDA is, on the GPU with the
# `auto` levers (fused loss, flex attention, compiled unroll), once uninterrupted and once cut
# at step 25 and resumed from its checkpoint; `draftsmith export` of each (the CUDA run's
# twice: with CUDA present and hidden). `device_train compare` checks the curves, the resume
# and the heads (its tolerances are in its docstring) and writes compare.json.
# Without CUDA (this CPU machine) it runs the CPU side and says what it would compare; with
# DRY=1 it runs the device half too, on the CPU (the same commands, accelerator cpu), so
# every step and the comparison are exercised before a GPU is spent on them.
#
#   bash tools/device_train.sh                   # figures and logs to $OUT (else outputs/device-train)
#   DRY=1 OUT=/tmp/dt bash tools/device_train.sh # the whole script on the CPU
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import jsonargparse" 2>/dev/null; then  # the device: carried wheels (make device-wheels)
    compgen -G ".whl/*.whl" >/dev/null || { echo "device_train: no jsonargparse and no .whl/" >&2; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/device-train}
W=${WORK:-/tmp/device-train}
STEPS=${STEPS:-50}
CUT=$((STEPS / 2))
rm -rf "$W" && mkdir -p "$W" "$OUT"
LOG=$OUT/device-train.log
: >"$LOG"
ds() { "$PY" -m draftsmith.cli "$@" >>"$LOG" 2>&1; }
fit() {  # fit RUN_DIR ACCELERATOR MAX_STEPS [more options]
    local run=$1 acc=$2 steps=$3
    shift 3
    ds train fit --config configs/train/tiny.yaml --data.data "$W/data" \
        --trainer.accelerator "$acc" --trainer.max_steps "$steps" --trainer.max_epochs -1 \
        --trainer.log_every_n_steps 1 --trainer.logger lightning.pytorch.loggers.CSVLogger \
        --trainer.logger.save_dir "$W/$run" --trainer.default_root_dir "$W/$run" \
        --checkpoint.dirpath "$W/$run/ck" --checkpoint.every_n_train_steps "$CUT" \
        --data.val_fraction 0.1 "$@"
}
t0=$SECONDS
"$PY" -m draftsmith.bench.device_train build --out "$W" | tee -a "$LOG"
CUDA_VISIBLE_DEVICES= fit cpu cpu "$STEPS"
CUDA_VISIBLE_DEVICES= ds export --checkpoint "$W/cpu/ck/last.ckpt" --output "$W/head-cpu"
echo "device_train: CPU run and export done ($((SECONDS - t0)) s)" | tee -a "$LOG"
ACC=
"$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" && ACC=gpu
[ -z "$ACC" ] && [ "${DRY:-0}" = 1 ] && ACC=cpu  # the device half on the CPU: checks the script
if [ -n "$ACC" ]; then
    fit cuda "$ACC" "$STEPS"
    fit cuda-resumed "$ACC" "$CUT"
    fit cuda-resumed "$ACC" "$STEPS" --ckpt_path "$W/cuda-resumed/ck/last.ckpt"
    ds export --checkpoint "$W/cuda/ck/last.ckpt" --output "$W/head-cuda"
    CUDA_VISIBLE_DEVICES= ds export --checkpoint "$W/cuda/ck/last.ckpt" --output "$W/head-cuda-on-cpu"
    echo "device_train: CUDA runs and exports done ($((SECONDS - t0)) s)" | tee -a "$LOG"
else
    echo "device_train: no CUDA here. On a GPU it would also train $STEPS steps on CUDA with the" \
        "auto levers, once uninterrupted and once cut at step $CUT and resumed, export that" \
        "head with CUDA present and hidden, and compare: the loss curve step for step with the" \
        "CPU run's, the resumed run's last loss with the uninterrupted one's, and the heads" \
        "(files, names, shapes, dtypes; CPU export = CUDA export bit for bit; CUDA vs CPU" \
        "head per tensor)." | tee -a "$LOG"
fi
set +e
"$PY" -m draftsmith.bench.device_train compare --out "$W" | tee -a "$LOG"
rc=${PIPESTATUS[0]}
cp "$W/compare.json" "$OUT/" 2>/dev/null
for run in cpu cuda cuda-resumed; do  # the curves, one file each (the device returns 8 files)
    [ -d "$W/$run" ] && cat "$W/$run"/lightning_logs/*/metrics.csv >"$OUT/metrics-$run.csv" 2>/dev/null
done
echo "device_train: $((SECONDS - t0)) s, compare exit $rc" | tee -a "$LOG"
# Without CUDA there is nothing to check against: the dry run passes when the CPU side ran.
[ -n "$ACC" ] || exit 0
exit "$rc"
