# The two set-up commands of the README: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: bootstrap test lint cpptest demo bench bench-env clean gpu-check gpu-check-ttft gpu-carry spdk-check

bootstrap:
	@bash scripts/bootstrap.sh

lint: bootstrap
	$(VENV)/bin/ruff check .

# Two workers, one per core: the serving room's tests (tests/kvpool, tests/kvio) on one, the
# rest on the other, each in order (tests/conftest.py groups them), so no two tests of a
# room share the machine's daemons, pools or engines at once (serially ~1 core was idle).
test: lint cpptest
	$(PY) -m pytest -q -ra --timeout=1200 -n 2 --dist loadgroup $(PYTEST_ARGS) tests

# C++ unit tests of the I/O engine (ctest), in their own CMake build tree (with fault injection).
cpptest: bootstrap
	$(VENV)/bin/cmake -S . -B build/cpptest -DCMAKE_BUILD_TYPE=Release -DKVPOOL_FAULT_INJECTION=ON \
		-DPython_EXECUTABLE=$(abspath $(PY)) -Dpybind11_DIR=$$($(PY) -m pybind11 --cmakedir) >/dev/null
	$(VENV)/bin/cmake --build build/cpptest --target kvio_unit_tests kvio_fault_tests -j 2 >/dev/null
	$(VENV)/bin/ctest --test-dir build/cpptest --output-on-failure

# The SPDK backend against real NVMe/TCP targets (docs/kvio-spdk.md, which says how SPDK was
# built for it): SPDK built outside the repo, SPDK_DIR its install prefix, the module rebuilt with
# PKG_CONFIG_PATH=$$SPDK_DIR/lib/pkgconfig and KVPOOL_CMAKE_ARGS="-DKVPOOL_FAULT_INJECTION=ON
# -DKVPOOL_WITH_SPDK=ON" (keeps make test's fault injection). Gives back the huge pages and the
# /dev/hugepages mount its targets took.
# CI has no SPDK: there these tests skip with the reason.
spdk-check:
	PY=$(PY) bash scripts/spdk_check.sh

demo: bootstrap
	$(PY) scripts/demo.py --out out

# The benchmark environment .venv-bench/ (the pins + LMCache 0.5.6, the rival); not part of test.
bench-env: bootstrap
	@bash scripts/bench_env.sh

bench: bootstrap
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# GPU validation kit (docs/gpu-check.md). On the lent GPU machine, whose image has no venv:
#   make gpu-check OUT=$$OUT          (python3 scripts/gpu_check.py --out $$OUT does the same)
# Here, the CPU dry run of the same harness: make gpu-check GPU_CHECK_ARGS=--dry-run
GPU_CHECK_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONUNBUFFERED=1 $(GPU_CHECK_PY) scripts/gpu_check.py --out $(or $(OUT),out/gpu-check) $(GPU_CHECK_ARGS)

# The long-prefix TTFT part (docs/gpu-check.md): a second device command after gpu-check.
gpu-check-ttft:
	PYTHONUNBUFFERED=1 $(GPU_CHECK_PY) scripts/gpu_check.py --parts ttft --out $(or $(OUT),out/gpu-check-ttft) $(GPU_CHECK_ARGS)

# Fetch the wheels and .debs a GPU run carries into .gpu-carry/ (needs PyPI and Debian).
gpu-carry:
	bash scripts/gpu_carry.sh

clean:
	rm -rf build out .pytest_cache .ruff_cache vllm_kvpool/_kvio*.so
