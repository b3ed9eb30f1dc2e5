# Two entry points; each sets up its own .venv (make test also needs npm and Chromium: README):
#   make test         - virtual environment, install with test extras, lint, type-check, all tests
#   make conformance  - the conformance suite on the default backend (Triton; interpreter on CPU)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# pytest workers: one per CPU, at least 2, at most 4 (each may hold a GiB or two)
WORKERS ?= $(shell $(PYTHON) -c "import os; print(max(2, min(4, len(os.sched_getaffinity(0)))))")
# conformance jobs: one per CPU, at most 4 (the examples are shared out as they come)
JOBS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")

.PHONY: venv test lint typecheck pytest conformance docs clean sandbox-deps

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]' -c constraints.txt
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# One thread per worker for torch and BLAS: the workers already fill the CPUs, and two-thread
# ops in each of them oversubscribe it (measured on 2 CPUs: 1,072 s, 858 s with one thread).
pytest: $(STAMP) sandbox-deps
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(WORKERS)

test: lint typecheck pytest

# The sandbox page (docs/sandbox.md) runs the spec in the browser: Pyodide from npm, pinned in
# docs_tools/pyodide/package-lock.json (`npm ci`; the docs build copies it into the site), and
# Debian's chromium for tests/test_sandbox_page.py (apt-get, when root and none is found).
sandbox-deps: $(STAMP)
	$(PY) -m docs_tools.sandbox_site
	$(PY) -m docs_tools.browser --install

# backend_gpu turns on Triton's interpreter by itself when there is no CUDA device.
conformance: $(STAMP)
	$(PY) -m conformance run --backend triton --jobs $(JOBS) --junit out/conformance.xml

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis site docs_tools/pyodide/node_modules
