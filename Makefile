# The few commands people need. Each creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: bench-full bench-more demo fuzz image nemesis ui ui-readonly test bench lint fmt clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

## demo: migrate the embedded database, load demo data, show what is there
# (always the embedded server: a QO_OPS_DATABASE_URL in your shell is ignored here)
demo: export QO_OPS_DATABASE_URL :=
demo: $(STAMP)
	$(BIN)/qo-ops db upgrade
	$(BIN)/qo-ops demo-data --tenants 3 --quotes 2000 --seed 1 --reset
	$(BIN)/qo-ops info
	$(BIN)/qo-ops run quote_expiration --tenant tenant-002 --mode dry-run
	$(BIN)/qo-ops run quote_expiration --tenant tenant-002 --mode execute --reason "make demo"
	$(BIN)/qo-ops demo-dagster --tenant tenant-001
	$(BIN)/qo-ops status
	@echo "these runs in the Dagster UI: make ui KEEP_DATA=1 (plain make ui starts over with fresh demo data)"

## ui: Dagster (webserver + daemon) on http://127.0.0.1:3000 over fresh demo data (embedded)
# It first replaces what the embedded database holds with fresh demo data, and says so;
# KEEP_DATA=1 keeps the data as it is (e.g. what `make demo` left); UI_PORT=3001 for another
# port (a port in use is refused before any data is replaced).
ui: export QO_OPS_DATABASE_URL :=
ui: UI_PORT ?= 3000
ui: $(STAMP)
	$(BIN)/qo-ops db upgrade
	$(BIN)/qo-ops dev --port $(UI_PORT) $(if $(filter-out 0,$(KEEP_DATA)),,--reset-demo-data)

## ui-readonly: the read-only Dagster UI (no launches) on http://127.0.0.1:3000 over the same instance
# (UI_PORT=… for another port; no daemon, no data reset: it shows what `make demo`/`make ui`
# left in the embedded server; see ops/dagster-ui/README.md)
ui-readonly: export QO_OPS_DATABASE_URL :=
ui-readonly: UI_PORT ?= 3000
ui-readonly: $(STAMP)
	$(BIN)/qo-ops db upgrade
	BIN=$(BIN) ops/dagster-ui/readonly-webserver.sh $(UI_PORT)

## test: the whole suite on a real PostgreSQL (embedded, or QO_OPS_TEST_DATABASE_URL)
# TEST_WORKERS pytest-xdist workers (each its own embedded server), each test file whole on
# one worker; TEST_WORKERS=0 runs it in one process. One file alone: .venv/bin/pytest FILE
test: TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup --durations=25

## fuzz: the operator API against its OpenAPI document (schemathesis), with a new random seed
# each time (printed; QO_OPS_FUZZ_SEED=N replays one); make test runs it with a fixed seed
fuzz: $(STAMP)
	QO_OPS_FUZZ_SEED=$${QO_OPS_FUZZ_SEED:-random} $(BIN)/pytest -s -p no:cacheprovider qo_ops_tests/api/test_api_fuzz.py

## image: the container image, built without a Docker daemon where needed (deploy/image/build.sh)
# IMAGE=registry.example.com/qo-ops:TAG names it; PYTHON_IMAGE=… picks the base (docs/deploy.md)
image:
	deploy/image/build.sh $(IMAGE)

## bench: measured speed, compared with a baseline in the same run
bench: $(STAMP)
	$(BIN)/python -m bench.suite

## bench-full: the published sizes (1,000,000 rows; 10,000,000 in the big tables), writes BENCHMARKS.md
bench-full: $(STAMP)
	$(BIN)/python -m bench.suite --profile full

## nemesis: replay one seed of the nemesis (bench/nemesis): its fault schedule, its checks
# SEED=40 ITERATIONS=12 (the figures `make test`'s nemesis and `make bench` print with a seed);
# always on a PostgreSQL of its own, which it restarts (QO_OPS_TEST_DATABASE_URL is ignored)
nemesis: export QO_OPS_TEST_DATABASE_URL :=
nemesis: SEED ?= 40
nemesis: ITERATIONS ?= 12
nemesis: $(STAMP)
	$(BIN)/python -m bench.nemesis --seed $(SEED) --iterations $(ITERATIONS)

## bench-more: the older single-purpose benchmarks (demo data load, delivery_retry concurrency)
bench-more: $(STAMP)
	$(BIN)/python -m bench.bench_demo_data
	$(BIN)/python -m bench.bench_quote_expiration
	$(BIN)/python -m bench.bench_delivery_retry

## lint: ruff and mypy on the package
lint: $(STAMP)
	$(BIN)/ruff check qo_ops qo_ops_tests bench
	$(BIN)/ruff format --check qo_ops qo_ops_tests bench
	$(BIN)/mypy

fmt: $(STAMP)
	$(BIN)/ruff format qo_ops qo_ops_tests bench
	$(BIN)/ruff check --fix qo_ops qo_ops_tests bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
