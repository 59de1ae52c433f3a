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

.PHONY: setup test test-fast test-kernels fuzz demo demo-check mission bench gpu-check gpu-deps experts bc

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(CONSTRAINTS),$(PY) -m pip install -q $(PIP_C) torch,)
	$(PY) -m pip install -q $(PIP_C) -e '.[dev]'
	$(PY) -m pip install -q $(PIP_C) --no-deps clean-fid==0.1.35  # FID's Inception (pyproject: extra sit)
	touch $@

setup: $(VENV)/.installed

test: setup
	DOPR_REQUIRE_OPTIONAL=1 $(PY) -m pytest -q

# The tier to run after every change: every test not marked `slow` (each module of dopr/ and
# experiments/ is at least imported, tests/suite/test_layout.py). 4 min 19 s on 2 cores (issue 63); `make test`
# stays the whole suite and what CI runs.
test-fast: setup
	$(PY) -m pytest -q -m "not slow" -p no:cacheprovider

# The numerically sensitive tests (marker `numerics`) again under other CPU kernels: ATen's portable
# (non-AVX) kernels and MKL's conditional-numerical-reproducibility path, which change the summation
# order of reductions, GEMMs and factorisations (bit patterns measured to differ on an AMD EPYC). A
# tolerance tuned to one machine's rounding fails here. About 1 minute on 2 cores.
# torch.compile's C++ code is built in a fresh inductor cache: its precompiled headers are keyed without
# the CPU capability, so a header that `make test` built for AVX2 broke the portable build here
# ("'at::vec' has not been declared" in tests/suite/test_sit.py's compiled run, in a clean clone's CI).
KERNELS ?= ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE
test-kernels: setup
	$(KERNELS) TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d) $(PY) -m pytest -q -m numerics

# The oracle (issue 73; docs/library.md, "The oracle"): DoPr against the float64 reference of
# tests/lib/oracle_reference.py on random models and options (Hypothesis), with random seeds, in rounds of
# ORACLE_EXAMPLES examples until FUZZ_MINUTES have passed; the first failure stops it, shrunk to a minimal
# example (Hypothesis keeps it in .hypothesis/ and replays it first next time). A change to dopr/ runs this
# before it lands; `make test` runs the oracle's fixed-seed tier.
FUZZ_MINUTES ?= 30
fuzz: setup
	end=$$(( $$(date +%s) + 60 * $(FUZZ_MINUTES) )); round=0; \
	while [ $$(date +%s) -lt $$end ]; do round=$$((round + 1)); echo "oracle round $$round"; \
		HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -p no:cacheprovider tests/lib/test_oracle.py || exit 1; \
	done

# DEMO_ARGS go to every run.py line and DEMO_OUT is where the tables go: `make demo-check` (CI) runs the
# same lines with DEMO_ARGS=debug=default into a temporary folder, so a broken main job cannot land.
DEMO ?= multirun/demo
DEMO_ARGS ?=
DEMO_OUT ?= results
DEMO_REPLACE := $(if $(filter results,$(DEMO_OUT)),--replace-results,)
demo: setup
	rm -rf $(DEMO) && mkdir -p $(DEMO) && date +%s > $(DEMO)/started   # fresh runs: a job resumes from its folder's checkpoint
	$(PY) run.py -m sweep=lds hydra.sweep.dir=$(DEMO)/lds $(DEMO_ARGS)
	$(PY) run.py -m task=feature_learning '+tuned/feature_learning_protocol=glob(*)' 'seed=range(1,11)' \
		sweep_name=feature_learning_protocol hydra.sweep.dir=$(DEMO)/feature_learning $(DEMO_ARGS)   # the protocol stage's runs, in one folder
	$(PY) run.py -m sweep=invariance hydra.sweep.dir=$(DEMO)/invariance $(DEMO_ARGS)
	$(PY) -m experiments.report $(DEMO)/lds $(DEMO)/feature_learning $(DEMO)/invariance --out $(DEMO_OUT) $(DEMO_REPLACE)
	$(PY) -m experiments.common.tuning report $(DEMO)/feature_learning \
		--selection results/feature_learning/protocol/selection.json --out $(DEMO_OUT)/feature_learning/protocol
	$(PY) -m experiments.common.results_changes --since $$(cat $(DEMO)/started)   # one line: what moved against HEAD

# The mission command of the README's first paragraph, as a user types it (MISSION_ARGS: CI's fast mode).
MISSION_ARGS ?=
mission: setup
	$(PY) run.py task=humanoid optim=dopr_adamw $(MISSION_ARGS) -m

# CI (.ci/run): every command line of `make demo` and the mission command in fast mode (debug=default),
# into a temporary folder; results/ must be left as committed.
demo-check: setup
	tmp=$$(mktemp -d) && \
	$(MAKE) --no-print-directory demo DEMO=$$tmp/demo DEMO_ARGS=debug=default DEMO_OUT=$$tmp/results && \
	$(MAKE) --no-print-directory mission MISSION_ARGS="debug=default hydra.sweep.dir=$$tmp/mission"
	@if [ -n "$$(git status --porcelain -- results)" ]; then \
		echo "demo-check: the fast demo changed results/:"; git status --short -- results; exit 1; fi

bench: setup
	$(PY) -m benchmarks.bench --out results/bench/cpu.md

# The GPU check (docs/gpu.md): DoPr's cost and numerics on one GPU, under 9 minutes, into
# results/bench/gpu_<device>.md. No virtual environment: the machine's python3 with a CUDA torch, the
# repository and the pure-Python dependencies carried in .gpu/deps (`make gpu-deps` where .venv is, then
# carry .gpu/ with the checkout). GPU_CHECK_ARGS go to benchmarks/gpu_check.py (e.g. --smoke --device cpu).
gpu-check:
	scripts/gpu_check.sh $(GPU_CHECK_ARGS)

gpu-deps: setup
	PYTHON=$(PY) scripts/gpu_deps.sh

# MuJoCo behaviour cloning (issue "MuJoCo BC"): SAC experts (resumable: rerun the same line), then the
# paper grids. Experts take tens of minutes (HalfCheetah) to hours (Humanoid) on CPU.
EXPERT_RUN = $(PY) run.py task=expert hydra.run.dir=outputs/expert/$(1) task.env=$(1)
experts: setup
	$(call EXPERT_RUN,HalfCheetah-v5) task.total_steps=400000 task.stop_at_return=7000
	$(call EXPERT_RUN,Humanoid-v5) task.obs_slice=45 task.stop_at_return=5500
	$(PY) -m experiments.bc.expert publish outputs/expert/HalfCheetah-v5
	$(PY) -m experiments.bc.expert publish outputs/expert/Humanoid-v5

bc: setup
	$(PY) run.py -m sweep=paper_halfcheetah hydra.sweep.dir=multirun/paper_halfcheetah/main
	$(PY) run.py -m sweep=paper_humanoid hydra.sweep.dir=multirun/paper_humanoid/main
	$(PY) -m experiments.report multirun/paper_halfcheetah/main multirun/paper_humanoid/main --out results --replace-results
