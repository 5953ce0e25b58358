# gym_rpc developer commands. `make test` is what CI runs (.ci/run): it installs what is missing first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BUF := node_modules/.bin/buf
STAMP := $(VENV)/.installed

.PHONY: install proto lint test run demo clean

install: $(STAMP) $(BUF)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(BUF): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $(BUF)

proto: $(STAMP)
	$(BIN)/python tools/generate_python_stubs.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BUF) lint

test: lint
	$(BIN)/python -m pytest -q

run: $(STAMP)
	$(BIN)/gym-rpc head

demo: $(STAMP)
	$(BIN)/gym-rpc demo

clean:
	rm -rf $(VENV) node_modules build *.egg-info .pytest_cache .mypy_cache .ruff_cache
