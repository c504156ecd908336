# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint sweep bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[demo,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tf32lab --help

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .

# Every float32 bit pattern against the integer reference (minutes; not part of `make test`).
sweep: $(STAMP)
	$(BIN)/python scripts/sweep_formats.py

bench: $(STAMP)
	$(BIN)/python benchmarks/formats.py
	$(BIN)/python benchmarks/scope.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
