# tierwatch: the two commands a user runs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DEMO_SECONDS ?= 0
DEMO_MTBF ?= 60
DEMO_SEED ?= 3
DEMO_PROMETHEUS ?= 0
PYTEST_ARGS ?=

.PHONY: demo test test-fast soak screenshot setup vendor lint format bench gpu-check images container-check clean

LOCKS := requirements/runtime.lock requirements/train.lock requirements/dev.lock

$(VENV)/.installed: pyproject.toml setup.py $(LOCKS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(addprefix -r ,$(LOCKS))
	$(PIP) install --quiet --no-deps -e .
	touch $@

static/vendor/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	mkdir -p static/vendor
	cp node_modules/htmx.org/dist/htmx.min.js static/vendor/htmx.min.js
	cp node_modules/uplot/dist/uPlot.iife.min.js static/vendor/uPlot.iife.min.js
	cp node_modules/uplot/dist/uPlot.min.css static/vendor/uPlot.min.css
	touch $@

setup: $(VENV)/.installed static/vendor/.installed

vendor: static/vendor/.installed

demo: setup
	DEMO_SECONDS=$(DEMO_SECONDS) DEMO_MTBF=$(DEMO_MTBF) DEMO_SEED=$(DEMO_SEED) \
	DEMO_PROMETHEUS=$(DEMO_PROMETHEUS) $(PY) scripts/demo.py

# The whole suite on $(TEST_WORKERS) pytest-xdist workers (each worker has its own
# SQLite file and PostgreSQL schema). `make test-fast` is the inner loop: no e2e, browser or
# slow tests. `make soak` runs the long kill -9 trials, `make screenshot` the README's picture.
TEST_WORKERS ?= 3
XDIST := -n $(TEST_WORKERS) --dist worksteal

test: setup lint
	$(VENV)/bin/pytest $(XDIST) $(PYTEST_ARGS)

test-fast: setup
	$(VENV)/bin/pytest $(XDIST) -m "not e2e and not browser and not slow and not soak and not screenshot and not gpu" $(PYTEST_ARGS)

soak: setup
	$(VENV)/bin/pytest -m soak --timeout=3600 $(PYTEST_ARGS)

screenshot: setup
	$(VENV)/bin/pytest -m screenshot $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy app agent

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: setup
	$(PY) bench/ingest.py
	$(PY) bench/checkpoint.py
	$(PY) bench/demo.py

# The server, agent and trainer images from docker/Dockerfile (scripts/images.sh): docker when
# its daemon answers, else buildah (a local debootstrap base), else podman; IMAGE_BUILDER picks
# one. Prints each image's size, user, and whether torch imports. Minutes; not part of `make test`.
images:
	scripts/images.sh

# docker-compose.yml's topology started inside those images (buildah run, the host's loopback
# and PostgreSQL), checked, and the table written into docs/deployment.md. Root; minutes; not
# part of `make test` (scripts/container_check.py).
container-check: setup
	$(PY) scripts/container_check.py

clean:
	rm -rf $(VENV) node_modules static/vendor var

# The GPU check (bench/gpu_check.py, docs/benchmarks.md "GPU check"): on a machine with a
# CUDA GPU, under 5 minutes on one H200; needs only the Python venv (no npm). Exits 2
# without CUDA; `$(PY) bench/gpu_check.py --dry-run-cpu` checks the script on CPU tensors.
# bench/gpu_check.py first: without CUDA it exits 2 with what is missing, before any test runs.
gpu-check: $(VENV)/.installed
	$(PY) bench/gpu_check.py
	$(VENV)/bin/pytest -m gpu $(PYTEST_ARGS)
