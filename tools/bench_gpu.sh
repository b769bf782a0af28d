#!/usr/bin/env bash
# `make bench-gpu`: the GPU training benchmark in one call (docs/benchmarks.md). Where the
# python has no jsonargparse (the device machine: no venv, no registry), the wheels carried in
# .whl/ (`make device-wheels`) are installed first into /tmp/site; then `draftsmith bench-gpu`
# runs with the arguments given. Figures and this log go to $OUT (else outputs/bench-gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import jsonargparse" 2>/dev/null; then
    if ! compgen -G ".whl/*.whl" >/dev/null; then
        echo "bench-gpu: $PY lacks jsonargparse and .whl/ holds no wheels: run" \
            "'make device-wheels' where pip works and carry .whl" >&2
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
out=${OUT:-outputs/bench-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
"$PY" -m draftsmith.cli bench-gpu --output "$out" "$@" 2>&1 | tee "$out/bench-gpu.log"
