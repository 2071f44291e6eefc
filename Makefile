# demo, test and bench-env use the local virtualenv .venv; bench-torchrec makes .venv-torchrec.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# setuptools notes on every editable install of a flat layout that folders named
# like a package may shadow it; here those folders are the packages. Only that
# note is filtered: other warnings and every error still show.
QUIET_EDITABLE := PYTHONWARNINGS="ignore:Editable installation"
# The lookup's CPU kernels (embedding/_cpu_kernels/), built with the
# machine's g++ against the installed jaxlib's FFI headers. Without a C++
# compiler a note says so and make goes on: the pure-JAX path runs (a
# compiler installed later builds the kernels at their first use).
KERNELS := $(VENV)/.kernels
TORCHREC_VENV := .venv-torchrec
TORCHREC_STAMP := $(TORCHREC_VENV)/.installed

.PHONY: demo test lint bench-env bench-torchrec clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(QUIET_EDITABLE) $(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

$(KERNELS): $(STAMP) $(wildcard embedding/_cpu_kernels/*)
	$(PY) -c "from embedding import _cpu_kernels; _cpu_kernels.prebuild()"
	touch $(KERNELS)

demo: $(KERNELS)
	$(VENV)/bin/sparseflow demo

# One test process per usable core, within the memory (pytest-xdist, with
# tests/worker_count.py): the suite takes about 0.8 of its sequential time
# on 2 cores, more where there are more.
test: $(KERNELS)
	$(PY) -m pytest -q -n auto

# The style the code is written in: lint rules and formatting, as pyproject.toml sets them.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The benchmark peers (jax-tpu-embedding) go into the same .venv on demand.
bench-env: $(STAMP)
	$(QUIET_EDITABLE) $(PY) -m pip install -q -e ".[dev,bench]"

# TorchRec, the peer of benchmarks/lookup.py, needs torch: it gets its own
# environment. fbgemm-gpu-cpu 1.8 matches torch 2.13 (1.9 is built for a newer
# torch); torchrec goes in with --no-deps, else pip pulls the CUDA fbgemm-gpu
# over the CPU one.
$(TORCHREC_STAMP):
	python3.11 -m venv $(TORCHREC_VENV)
	$(TORCHREC_VENV)/bin/pip install torch==2.13.0 tensordict iopath pyre-extensions torchmetrics
	$(TORCHREC_VENV)/bin/pip install fbgemm-gpu-cpu==1.8.0
	$(TORCHREC_VENV)/bin/pip install --no-deps torchrec==1.8.0
	touch $(TORCHREC_STAMP)

bench-torchrec: $(TORCHREC_STAMP)

clean:
	rm -rf $(VENV) $(TORCHREC_VENV) runs embedding/_cpu_kernels-*.so
