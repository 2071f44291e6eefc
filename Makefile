# Both targets create and use the local virtualenv .venv.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench-env clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sparseflow demo

test: $(STAMP)
	$(PY) -m pytest -q

# The benchmark peers (jax-tpu-embedding) go into the same .venv on demand.
bench-env: $(STAMP)
	$(PY) -m pip install -q -e ".[dev,bench]"

clean:
	rm -rf $(VENV) runs
