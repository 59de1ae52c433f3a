# Two commands do everything on a fresh machine:
#   make test   create (or reuse) .venv, install dopr with its test extras, run the tests
#   make demo   same environment, run the embedded default main job: the paper's theory sweeps
#               (LDS, feature learning, invariance) and their tables and figures under results/
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

DEMO := multirun/demo
demo: setup
	$(PY) run.py -m sweep=lds hydra.sweep.dir=$(DEMO)/lds
	$(PY) run.py -m sweep=feature_learning hydra.sweep.dir=$(DEMO)/feature_learning
	$(PY) run.py -m sweep=invariance hydra.sweep.dir=$(DEMO)/invariance
	$(PY) -m experiments.report $(DEMO)/lds $(DEMO)/feature_learning $(DEMO)/invariance

bench: setup
	$(PY) -m dopr.bench --out results/bench/cpu.md
