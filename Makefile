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

# Real routers for the KV event tests: NVIDIA Dynamo's standalone indexer in a venv of its own
# (it pins its own pydantic), and vLLM's event classes as its release ships them, taken from the
# wheel without vLLM's dependencies.
DYNAMO_VERSION := 1.6.1
VLLM_VERSION := 0.34.0
ROUTERS_STAMP := $(VENV)/.routers-$(DYNAMO_VERSION)-$(VLLM_VERSION)

.PHONY: run test test-fast test-deps routers lint bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINT) -e .
	touch $@

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -q -c $(CONSTRAINT) -e '.[$(DEV_EXTRAS)]'
	touch $@

$(ROUTERS_STAMP): $(STAMP)
	$(PYTHON) -m venv $(VENV)/dynamo
	$(VENV)/dynamo/bin/python -m pip install -q ai-dynamo-runtime==$(DYNAMO_VERSION)
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d $(VENV)/wheels vllm==$(VLLM_VERSION)
	$(PY) -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2], \
		["vllm/distributed/kv_events.py", "vllm/v1/core/kv_cache_utils.py"])' \
		$(VENV)/wheels/vllm-$(VLLM_VERSION)-*.whl $(VENV)/vllm-events
	rm -f $(VENV)/wheels/vllm-$(VLLM_VERSION)-*.whl
	touch $@

routers: $(ROUTERS_STAMP)

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

test: $(DEV_STAMP) $(ROUTERS_STAMP) test-deps
	$(PY) -m ruff check .
	$(PY) -m pytest -q

# The same without tests/e2e/ (real service, Prometheus and worker processes): for the edit loop.
test-fast: $(DEV_STAMP) $(ROUTERS_STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q --ignore=tests/e2e

lint: $(DEV_STAMP)
	$(PY) -m ruff check .

bench: $(DEV_STAMP)
	$(PY) benchmarks/bench_step.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
