# InferMesh: the two commands a newcomer needs are `make run` and `make test`.
# Both create .venv and install everything themselves (tools/install.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.infermesh-installed
MODELS ?= models
PORT ?= 8001

.PHONY: run test lint typecheck unit doctor models bench clean

$(STAMP): pyproject.toml tools/install.sh
	bash tools/install.sh
	touch $(STAMP)

doctor: $(STAMP)
	$(PY) -m infermesh.doctor

models: $(STAMP)
	$(PY) -m model_server.demo_models --out $(MODELS)

run: models
	@echo "Model server on 127.0.0.1:$(PORT) (Prometheus metrics on :$$(( $(PORT) + 1000 ))); Ctrl-C drains and stops."
	@echo "Call it:  $(PY) examples/classify.py --url 127.0.0.1:$(PORT)"
	$(PY) -m model_server --model-repository $(MODELS) --port $(PORT)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

test: lint typecheck
	$(VENV)/bin/python -m pytest -q

bench: models
	$(PY) bench/bench_model_server.py --models $(MODELS)

clean:
	rm -rf $(VENV) $(MODELS) .mypy_cache .ruff_cache .pytest_cache .hypothesis
