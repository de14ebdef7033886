# lanekv: the commands a developer and CI run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch that lies on the build machines' disk; the GPU machines bring their own.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# Test processes (pytest-xdist), one per CI core. Each takes whole files (--dist loadfile),
# so a module's daemons and checkpoints are started once. Tests bind port 0 or pick free
# ports for daemons that must restart on the same one, rank groups meet at a store their
# starter already holds (model/parallel/rendezvous.py), and /dev/shm files are named by pid, so
# the two processes' tests do not meet.
TEST_JOBS ?= 2
# A test process that dies is not replaced: the run ends at once, naming the test it died
# in. (pytest-xdist 3.8 can wait for ever at the end of a --dist loadfile run that replaced one.)
XDIST := -n $(TEST_JOBS) --dist loadfile --max-worker-restart 0

.PHONY: install test test-fast lint bench proto demo tiny-model clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	# lanekv[nixl] without its dependencies: its unpinned torch must not replace ours
	$(PY) -m pip install -q --no-deps "nixl-cu13>=1.5,<1.6"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=25 $(XDIST) tests

# The unit tests: everything but the end-to-end tests that start daemons (marked slow
# by tests/conftest.py) and the GPU tests.
test-fast: $(STAMP)
	$(PY) -m pytest -q -ra $(XDIST) -m "not slow and not gpu" tests

lint: $(STAMP)
	$(PY) -m ruff check .

# CPU benchmarks (small sizes); the GPU ones and their commands are in BENCHMARKS.md.
bench: $(STAMP)
	$(PY) bench/planner.py
	$(PY) bench/transfer.py --tokens 4096 --servers 1,2 --repeats 1
	$(PY) bench/prefill.py --tiny --tokens 256 1024 --cp 1 2 --page-size 16 --repeat 2
	$(PY) bench/e2e.py --tiny --cp 2 --page-size 16 --prompt-tokens 256 1024 --batches 1 16 --max-new-tokens 16 --repeat 1
	$(PY) bench/ttft.py --tiny --cp 2 --page-size 16 --tokens 256 1024 --repeat 1

# A 2-rank prefill daemon and a decode daemon as processes, one generation, checked
# against a single-process run. MODEL=DIR uses a real checkpoint; DEMO_ARGS adds flags
# (e.g. DEMO_ARGS="--dtype bfloat16 --prompt 'Hello'"; see python -m lanekv.demo --help).
demo: $(STAMP)
	$(PY) -m lanekv.demo $(if $(MODEL),--model "$(MODEL)") $(DEMO_ARGS)

# A random-weight Llama checkpoint with a tokenizer and a chat template (README's quick start).
tiny-model: $(STAMP)
	$(PY) -m lanekv.cli tiny-model $(or $(DIR),tiny-model)

proto: $(STAMP)
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
