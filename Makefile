# Two commands do everything on a fresh machine:
#   make test   create (or reuse) .venv, install dopr with its test extras, run the tests
#   make demo   same environment, run the drop-in quickstart (AdamW vs DoPr-AdamW)
# CPU path: torch is pinned by constraints-cpu.txt (a GPU user installs the CUDA build of a torch
# inside pyproject's range first and runs `make test CONSTRAINTS=`).
VENV ?= .venv
PY := $(VENV)/bin/python
CONSTRAINTS ?= constraints-cpu.txt
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)

.PHONY: setup test demo bench

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(CONSTRAINTS),$(PY) -m pip install -q $(PIP_C) torch,)
	$(PY) -m pip install -q $(PIP_C) -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -q

demo: setup
	$(PY) examples/quickstart.py

bench: setup
	$(PY) -m dopr.bench --out results/bench/cpu.md
