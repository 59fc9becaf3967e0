# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both bootstrap a git-ignored .venv on first use and reuse it afterwards.
# torch is pinned and installed *first*, so that the project's `torch>=2.10`
# is already satisfied and pip never pulls a multi-GB CUDA build.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.ripresa-installed

.PHONY: demo test test-long lint bench venv clean soak test-gpu

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,engine]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m ripresa demo $(if $(DEMO_OUT),--output $(DEMO_OUT))

# The default tier on two workers (a 2-core CI machine: under 5 minutes); one worker: make test XDIST=0.
XDIST ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --durations=20 $(if $(filter-out 0,$(XDIST)),-n $(XDIST))

test-long: $(STAMP)
	$(PY) -m pytest -q -m slow

# The whole fault and bad-input matrix (kill points, power loss, full disks,
# hostile files, concurrent writers, HMAC): tens of minutes; prints the table
# and writes build/faults/faults.json. `make test` runs a sample of each family.
.PHONY: test-faults
test-faults: $(STAMP)
	$(PY) tests/faults/report.py --out build/faults

# The soak (docs/FAULTS.md, "The soak"): >= 1,000 real interruptions of three real
# training loops, each final state compared bitwise; prints the table and writes
# build/soak/soak.json. Under 60 minutes on 2 cores; root mounts its small tmpfs.
# Its nodes lane (two torchrun nodes on node-local folders, committed through S3)
# takes 16 of the interruptions (--nodes-interruptions), ~4-8 minutes.
soak: $(STAMP)
	$(PY) tests/soak/soak.py $(if $(SEED),--seed $(SEED))

# The tests marked cuda (tests/test_gpu.py): skipped without a GPU.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m cuda tests/test_gpu.py

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/lint-imports

bench: $(STAMP)
	$(PY) benchmarks/bench_checkpoint.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
