# gym_rpc developer commands. `make test` is what CI runs (.ci/run): it installs what is missing first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BUF := node_modules/.bin/buf
RELEASED_CONTRACT := proto/released/gym_rpc_v1.binpb
RELEASED_VERSION := proto/released/VERSION
STAMP := $(VENV)/.installed
# `make demo` on a fresh machine: a venv of its own with only what the demo needs (the base install and [head]).
DEMO_VENV := .venv-demo
DEMO_STAMP := $(DEMO_VENV)/.installed

.PHONY: install proto stubs release-contract lint test test-fast run demo bench bench-scale mutate clean nemo-gym-venv \
	lowest-versions-venv

install: $(STAMP) $(BUF)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# `npm ci` installs every pinned npm tool at once (buf, protoc-gen-es, connect, tsx, tsc): buf stands for them all.
$(BUF): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $(BUF)

proto: $(STAMP)
	$(BIN)/python tools/generate_python_stubs.py

# TypeScript and Go stubs into stubs/ (git-ignored, made on demand) by buf.gen.yaml's local plugins, made into
# packages: stubs/npm (npm package @gym-rpc/control-plane, packed into stubs/*.tgz) and stubs/go (Go module
# gym_rpc/stubs/go). The Go plugins are Debian's: apt-get install protoc-gen-go protoc-gen-go-grpc (.ci/run does).
stubs: $(BUF)
	@for plugin in protoc-gen-go protoc-gen-go-grpc; do command -v $$plugin >/dev/null || \
		{ echo "$$plugin not found: apt-get install protoc-gen-go protoc-gen-go-grpc" >&2; exit 1; }; done
	$(BUF) generate
	$(PYTHON) tools/package_stubs.py stubs
	npm pack --silent --pack-destination stubs ./stubs/npm

# Record proto/ as the released contract, with its version (proto/VERSION): `make lint` runs `buf breaking` against
# this image. Run it only when releasing; within v1 the image must stay what it was, or breaking changes would slip
# through. tests/wire/test_interop.py checks that proto/VERSION is raised whenever proto/ differs from this image.
release-contract: $(BUF)
	$(BUF) build -o $(RELEASED_CONTRACT)
	cp proto/VERSION $(RELEASED_VERSION)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(BUF) lint
	$(BUF) breaking --against $(RELEASED_CONTRACT)

# NeMo Gym's own code (tests/nemo_gym/test_nemo_gym_compat.py) runs in a venv of its own: Python >= 3.13, `nemo-gym` from the
# registry. Built once (a minute or two), then reused until its requirements change; prints SKIP without Python 3.13+.
nemo-gym-venv: $(STAMP)
	$(BIN)/python tools/nemo_gym_venv.py

# Every runtime dependency at the lowest version pyproject.toml declares, for tests/project/test_lowest_versions.py (which
# runs tests/lowest_versions.txt there): built once (a few minutes), then reused until the floors change.
lowest-versions-venv: $(STAMP)
	$(BIN)/python tools/lowest_versions_venv.py

# The suite runs on parallel workers (pytest-xdist), each test module whole on one worker, so its module fixtures (a
# PKI, a Go build, a wheel) are made once. More workers than the 2 cores: most tests wait on sockets, timers and
# subprocesses. Modules are handed out in the order tests/support/tiers.py sorts them (builds, then the modules that
# start the most processes), not xdist's by number of tests, which handed the long build modules out late. Tests
# marked `load` (floods, timings) then run alone, after the rest; either run failing fails.
# 6, not 4: on an idle 2-core machine the parallel run took 340 s with 6 and 391 s with 4 (1,543 tests, same clone).
TEST_WORKERS ?= 6
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test: lint nemo-gym-venv lowest-versions-venv
	$(BIN)/python -m pytest -q --durations=25 $(PYTEST_PARALLEL) -m "not load"; parallel=$$?; \
	$(BIN)/python -m pytest -q --durations=5 -m load; alone=$$?; \
	if [ $$parallel -ne 0 ]; then exit $$parallel; fi; exit $$alone

# The edit loop: in-process tests only (no test marked process, build or load; tests/support/tiers.py), no lint.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) -m "not process and not build and not load"

run: $(STAMP)
	$(BIN)/gym-rpc head

$(DEMO_STAMP): pyproject.toml
	test -x $(DEMO_VENV)/bin/python || $(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install --quiet -e '.[head]'
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(DEMO_VENV)/bin/gym-rpc demo

# Benchmarks against baselines measured in the same run (about 15 min on a quiet 2-core machine, 25 at load 13-16:
# each row's rounds have a time budget, bench.stats.Budget); prints the ratio table, writes bench/RESULTS.md.
# Not part of `make test` (tests/bench/test_bench_smoke.py runs `python -m bench --quick`, test_bench_restart.py and
# test_bench_relay.py the others, so the code cannot rot).
bench: $(STAMP)
	$(BIN)/python -m bench

# How one head's costs grow with servers, watchers and pollers (< 5 min); writes bench/SCALE.md.
bench-scale: $(STAMP)
	$(BIN)/python -m bench.scale

# Mutation testing (mutmut, `[tool.mutmut]` in pyproject.toml) of the security, redaction, config, rollout-prefix,
# watch and data-plane retry modules; keeps both cores busy for up to half an hour (`rm -rf mutants` first for a run
# from scratch: results stay in mutants/, git-ignored, and a second run re-tests only what changed). The venv comes
# first on PATH for the mypy pass. Writes bench/MUTATION.md.
# 4 workers on 2 cores: the selected tests mostly wait on sockets and timers (2 workers left the load under 1).
MUTATE_WORKERS ?= 4
mutate: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[mutation]'
	started=$$(date +%s); load_start="$$(cut -d' ' -f1-3 /proc/loadavg)"; \
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/mutmut run --max-children $(MUTATE_WORKERS) || true; \
	$(BIN)/python tools/mutation_report.py --seconds $$(( $$(date +%s) - started )) --load-start "$$load_start" \
		--load "$$(cut -d' ' -f1-3 /proc/loadavg)" --commit "$$(git rev-parse --short HEAD)" --workers $(MUTATE_WORKERS) > bench/MUTATION.md
	@tail -n 1 bench/MUTATION.md

clean:
	rm -rf $(VENV) $(DEMO_VENV) .venv-nemo-gym .venv-lowest .venv-*.lock mutants node_modules build *.egg-info .pytest_cache .mypy_cache .ruff_cache
