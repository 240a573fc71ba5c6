# InferMesh: the two commands a newcomer needs are `make run` and `make test`.
# Both create .venv and install everything themselves (tools/install.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.infermesh-installed
MODELS ?= models

.PHONY: run test test-fast test-containers lint typecheck doctor models bench clean

$(STAMP): pyproject.toml tools/install.sh
	bash tools/install.sh
	touch $(STAMP)

doctor: $(STAMP)
	$(PY) -m infermesh.doctor

models: $(STAMP)
	$(PY) -m model_server.demo_models --out $(MODELS)
	$(PY) -m model_server.demo_lm --out $(MODELS) --keep

run: models
	$(VENV)/bin/infermesh up

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The whole suite, fast tier first: a broken build fails in about a minute, before the tests
# that start real processes (about 11 minutes) run, and the container tier (a few minutes)
# last.
test: lint typecheck
	$(VENV)/bin/python -m pytest -q -x -m "not integration and not containers"
	$(VENV)/bin/python -m pytest -q -m integration
	$(MAKE) --no-print-directory test-containers

# The container tier: installs Docker Engine and Compose (root Debian hosts), starts dockerd if
# none runs (and stops it after), builds the base and the image (cached between runs), and runs
# compose.private.yaml's scenarios in real containers. Prints each scenario's figures and its
# time.
test-containers: $(STAMP)
	@start=$$(date +%s); \
	$(VENV)/bin/python -m pytest -q -rP -m containers tests/containers; rc=$$?; \
	echo "make test-containers: $$(( $$(date +%s) - start )) s"; \
	exit $$rc

# The fast tier: lint, types and every test that starts no server process; prints its time.
test-fast: $(STAMP)
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory lint typecheck && \
	$(VENV)/bin/python -m pytest -q -x -m "not integration and not containers"; rc=$$?; \
	echo "make test-fast: $$(( $$(date +%s) - start )) s (lint, types and the tests that start no process)"; \
	exit $$rc

bench: models
	$(PY) bench/bench_model_server.py --models $(MODELS)

clean:
	rm -rf $(VENV) $(MODELS) .infermesh .mypy_cache .ruff_cache .pytest_cache .hypothesis
