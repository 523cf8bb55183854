# Quick start targets. `make run` and `make test` create .venv on first use.
#
# By default the venv is isolated and torch is kept at the release of constraints-cpu.txt.
# `make SYSTEM_TORCH=1 ...` builds the venv over this interpreter's site-packages instead and
# pins nothing, so a torch that is already installed (a CUDA build, say) is the one used; the
# older spelling `make TORCH_CONSTRAINT=/dev/null ...` means the same. Switching between the two
# needs `make clean` first.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
TORCH_CONSTRAINT ?= constraints-cpu.txt
SYSTEM_TORCH ?= $(if $(filter /dev/null,$(TORCH_CONSTRAINT)),1,)
CONSTRAINT := $(if $(SYSTEM_TORCH),/dev/null,$(TORCH_CONSTRAINT))
VENV_FLAGS := $(if $(SYSTEM_TORCH),--system-site-packages,)
# Two stamps: `serve` needs the package alone; the tests and `kvalloc worker` add the dev and
# worker extras (Triton, transformers: gigabytes that `make run` never imports).
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
DEV_EXTRAS := dev,worker

.PHONY: run test test-fast test-deps lint bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINT) -e .
	touch $@

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -q -c $(CONSTRAINT) -e '.[$(DEV_EXTRAS)]'
	touch $@

run: $(STAMP)
	$(VENV)/bin/kvalloc serve

# The Prometheus tests run Debian's prometheus and promtool; without them they skip.
test-deps:
	@if command -v prometheus >/dev/null && command -v promtool >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing prometheus (prometheus + promtool) for the Prometheus tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends prometheus; \
	else \
		echo "NOTE: prometheus and promtool are not on PATH, so the Prometheus tests will skip."; \
		echo "      Install them (Debian/Ubuntu: sudo apt-get install prometheus) to run them."; \
	fi

test: $(DEV_STAMP) test-deps
	$(PY) -m ruff check .
	$(PY) -m pytest -q

# The same without tests/e2e/ (real service, Prometheus and worker processes): for the edit loop.
test-fast: $(DEV_STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q --ignore=tests/e2e

lint: $(DEV_STAMP)
	$(PY) -m ruff check .

bench: $(DEV_STAMP)
	$(PY) benchmarks/bench_step.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
