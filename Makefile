# tierwatch: the two commands a user runs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DEMO_SECONDS ?= 0
DEMO_MTBF ?= 60
DEMO_SEED ?= 3
PYTEST_ARGS ?=

.PHONY: demo test setup vendor lint bench clean

$(VENV)/.installed: pyproject.toml setup.py requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -r requirements.lock
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
	DEMO_SECONDS=$(DEMO_SECONDS) DEMO_MTBF=$(DEMO_MTBF) DEMO_SEED=$(DEMO_SEED) $(PY) scripts/demo.py

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest $(PYTEST_ARGS)

bench: setup
	$(PY) bench/ingest.py
	$(PY) bench/checkpoint.py
	$(PY) bench/demo.py

clean:
	rm -rf $(VENV) node_modules static/vendor var
