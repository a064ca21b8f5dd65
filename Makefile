# The two set-up commands of the README: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: bootstrap test lint demo bench clean

bootstrap:
	@bash scripts/bootstrap.sh

lint: bootstrap
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q -ra --timeout=1200 $(PYTEST_ARGS) tests

demo: bootstrap
	$(PY) scripts/demo.py --out out

bench: bootstrap
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf build out .pytest_cache .ruff_cache vllm_kvpool/_kvio*.so
