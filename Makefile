# Quick start targets. `make run` and `make test` create .venv on first use.
# CPU machines pin torch to the local CPU build; on a CUDA machine use
# `make TORCH_CONSTRAINT=/dev/null ...` to keep the torch that is already installed.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CONSTRAINT ?= constraints-cpu.txt
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(TORCH_CONSTRAINT) -e '.[dev,worker]'
	touch $@

run: $(STAMP)
	$(VENV)/bin/kvalloc serve

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/bench_host.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
