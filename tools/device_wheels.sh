#!/usr/bin/env bash
# `make device-wheels`: download into .whl/ (git-ignored) the wheels the device machine's image
# lacks, for its python3 (CPython 3.12, x86-64 Linux); tools/bench_gpu.sh installs them there,
# where no registry can be reached. docs/benchmarks.md gives the `run` call that carries them.
#
# The list was found by importing draftsmith's bench modules and speculators' EAGLE-3 model
# with only the image's packages (/work/.library/device/KINDS.md) plus these wheels on the path.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=.whl
WHEELS=(
    # draftsmith's config parser, what it reads docstrings and types with, and dill
    jsonargparse==4.53.0 docstring_parser==0.18.0 typeshed_client==2.15.0 dill==0.4.1
    # speculators 0.9.0 and what importing its EAGLE-3 model pulls in that the image lacks
    speculators==0.9.0 hs-connectors==0.9.0
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0  # pydantic 2.14 needs >= 4.16; newer is backward compatible
    openai==2.54.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1  # openai 3 needs httpx2
    datasets==5.1.0 multiprocess==0.70.19  # speculators pins datasets <= 5.1.0
)
rm -rf "$DEST"  # one version of each: two stop the device's install
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEST" "${WHEELS[@]}" 2>&1 |
    { grep -v "is ignored: it is neither" || true; }
echo "$(ls "$DEST" | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST/"
