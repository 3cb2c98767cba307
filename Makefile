# One entry point for people, CI and the Docker images: they all call these targets.
VENV   ?= $(CURDIR)/.venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.prunex-setup-ok
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
export PIP_NO_WARN_SCRIPT_LOCATION := 0

.PHONY: setup test test-fast demo compare bench python clean

# idempotent: a second run only checks (seconds); the Horovod wheel is cached in ~/.cache/prunex_hvd
setup: $(STAMP)
$(STAMP): scripts/setup.sh scripts/build_horovod.sh setup.cfg pyproject.toml
	VENV=$(VENV) bash scripts/setup.sh
	@touch $@

# pytest-xdist workers for the tests without launches (each launch runs 4-8 ranks: those run one at a time)
TEST_JOBS ?= 2

# everything, real mpirun / horovodrun / torchrun launches included (what CI runs); a tier with nothing
# selected (pytest's exit status 5, say under a PYTEST_ARGS path) is not a failure
test: setup
	$(PY) -m pytest -q -rfEs -m "not launch" -n $(TEST_JOBS) $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest -q -rfEs -m launch $(PYTEST_ARGS) || [ $$? -eq 5 ]

# the developer's loop: everything but the real launches (tests marked `launch`)
test-fast: setup
	$(PY) -m pytest -q -rfEs -m "not launch" -n $(TEST_JOBS) $(PYTEST_ARGS)

demo: setup
	bash scripts/demo.sh $(PY)

compare: setup
	bash scripts/compare.sh $(PY)

bench: setup
	$(PY) benchmarks/bench_collectives.py

python:
	@echo $(abspath $(PY))

clean:
	rm -rf $(VENV) .pytest_cache
