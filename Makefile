# README's two commands: `make demo` (set up + run the main job on the embedded local scheduler)
# and `make test` (set up + lint + type check + the whole test suite); `make check` is the edit loop.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv bytecode check test test-serial lint typecheck unit cluster pbs demo golden docs bench gpu-check cluster-up cluster-down clean

# torch is pinned first: a plain `torch` requirement would pull a multi-GB CUDA build here.
# Quiet pip, so each step says what it is doing: torch alone takes about a minute.
$(STAMP): pyproject.toml
	@echo "setting up $(VENV): a virtual environment ..."
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "installing torch 2.13.0 (CPU build; about a minute) ..."
	$(BIN)/pip install -q torch==2.13.0
	@echo "installing hpclaunch and its dependencies ..."
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)
	@echo "$(VENV) is ready"

venv: $(STAMP)

# hpclaunch's own modules compiled once: where PYTHONDONTWRITEBYTECODE is set (CI's machines), every
# process (each CLI call, agent, rank host) compiled the ~100-250 modules it imports from source
# again, 0.35 s of CPU a CLI call. Only what changed since is compiled again.
bytecode: venv
	$(BIN)/python -m compileall -q -j 0 src bench > /dev/null

lint: venv
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

typecheck: venv
	$(BIN)/mypy

# The edit loop, under a minute: lint, types and the pure-logic tests (marked `fast`, not `spawns`:
# no process started, no torch.distributed group, no cluster; tests/conftest.py fails a `fast`
# test that starts a process). `make test` is what CI runs.
check: lint typecheck bytecode
	HPCLAUNCH_FAST_GUARD=1 $(BIN)/pytest -q -m "fast and not spawns" -p no:cacheprovider

# Everything: unit, integration (real torchrun + gloo), slow and cluster tests (real local SLURM
# and OpenPBS; skipped with a reason when they cannot start, an error when
# HPCLAUNCH_REQUIRE_SLURM=1 / HPCLAUNCH_REQUIRE_PBS=1 as in CI). What CI runs.
# TEST_WORKERS (3) pytest-xdist workers (tests/conftest.py): each real cluster's tests in one worker,
# in order, and started first; every other module whole, handed to whichever worker is free. Three:
# since the CPU cuts of 48b5581 the suite (~55 core-minutes) no longer keeps 2 cores busy with two
# workers, and the real-SLURM chain (~24-27 min, mostly waiting on SLURM) is what a third worker
# leaves as the run's length (docs/figures.md). `make test-serial` is the one-process run.
TEST_WORKERS ?= 3
PYTEST_ARGS ?=
test: lint typecheck bytecode
	$(BIN)/pytest -q -n $(TEST_WORKERS) --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

test-serial: lint typecheck bytecode
	$(BIN)/pytest -q --durations=15

unit: bytecode
	$(BIN)/pytest -q -m "not slow and not slurm and not pbs"

cluster: bytecode
	$(BIN)/pytest -q -m slurm

pbs: bytecode
	$(BIN)/pytest -q -m pbs

# Accept changed golden job scripts after reviewing the diff.
golden: venv
	HPCLAUNCH_UPDATE_GOLDEN=1 $(BIN)/pytest -q tests/unit/test_render_golden.py

# Regenerate the config reference (docs/configuration.md) from the schema.
docs: venv
	$(BIN)/python scripts/update_readme_reference.py

DEMO_RUN := runs/tiny-demo
demo: venv bytecode
	# the demo data is made once; a second `make demo` reuses it
	test -d data/tiny/tokens || $(BIN)/hpclaunch data synth data/tiny --samples 1024
	rm -rf $(DEMO_RUN)
	# A 40 s limit per attempt and a slowed tiny model (0.2 s/step, the math unchanged): 360 steps are
	# 72 s of training, more than two attempts can hold even with a 3 s start-up, so the run is
	# stopped, saved and requeued at least twice before it finishes; --wait prints its status (where
	# the wall-clock time went, the goodput), then the report's figures show every stop.
	$(BIN)/hpclaunch submit examples/tiny.yaml --set name=tiny-demo --set scheduler.time_limit=40s \
		--set train.steps=360 --set testing.step_sleep_s=0.2 --set launch.stop_margin_s=2 --wait
	$(BIN)/hpclaunch report $(DEMO_RUN)

bench: venv
	$(BIN)/python bench/trainer_overhead.py
	$(BIN)/python bench/checkpoint_stall.py
	$(BIN)/python bench/restart_cost.py  # its SLURM scenario needs the local cluster (root)
	$(BIN)/python bench/watchdog.py
	$(BIN)/python bench/data_path.py
	$(BIN)/python bench/fsdp_vs_ddp.py

# On a machine with GPUs (a CUDA build of torch 2.13 in .venv): bf16 FSDP steps of a ~1B MMDiT on
# every visible GPU, MFU, peak memory, async-checkpoint stall, determinism and bitwise resume.
gpu-check: venv
	$(BIN)/python bench/gpu_check.py --out gpu-check.json

cluster-up:
	scripts/local-slurm up

cluster-down:
	scripts/local-slurm down

clean:
	rm -rf $(VENV) runs data .pytest_cache .mypy_cache .ruff_cache
