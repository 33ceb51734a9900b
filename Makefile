# Every target sets itself up: a .venv with torch (TORCH, default the CPU
# wheel torch==2.13.0), torchao, and this package built against that torch.
# To use a torch you already have: make test VENV_FLAGS=--system-site-packages TORCH=
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
VENV_FLAGS ?=
EXTRAS ?= dev,demo,onnx,executorch,models,trained
DEMO_OUT ?= demo-out
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pt2e_fq-installed
SOURCES := $(shell find pt2e_fq/csrc -type f) setup.py pyproject.toml
NVCC ?= nvcc
CUDA_HOME ?= /usr/local/cuda
CUDA_ARCHS ?= 80 90

.PHONY: setup test bench demo cuda-check clean

setup: $(STAMP)

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel ninja
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	@# An in-place _C built before the abi3 build (_C.cpython-3X-*.so) would be
	@# imported ahead of the new _C.abi3.so.
	rm -f pt2e_fq/_C.cpython-*.so
	$(PY) -m pip install -q --no-build-isolation -e ".[$(EXTRAS)]"
	touch $@

# The whole suite, on every core (pytest-xdist). Tests go to whichever
# worker is free, but those of one xdist_group (modules whose fixtures build
# many models) stay on one worker, which builds them once.
test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadgroup

# Every benchmark script, one after the other (each prints its tables).
bench: $(STAMP)
	@for f in benchmarks/bench_*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

# Trains a CNN on scikit-learn's digits, quantizes it (PTQ w8a8, QAT w4a8),
# exports it and prints the table; files under $(DEMO_OUT).
demo: $(STAMP)
	$(VENV)/bin/pt2e-fq demo --out $(DEMO_OUT)

# Compiles every CUDA kernel (they include no torch header) for each arch,
# and syntax-checks the torch bindings of the CUDA kernels, on machines
# without a GPU or a CUDA build of torch. A CPU torch lacks one generated
# header (c10/cuda/impl/cuda_cmake_macros.h); an empty stand-in suffices.
cuda-check: $(STAMP)
	@for f in $$(find pt2e_fq/csrc/cuda -name '*.cu'); do \
	  for a in $(CUDA_ARCHS); do \
	    echo "nvcc sm_$$a $$f"; \
	    $(NVCC) -std=c++17 -O3 --fmad=false -Ipt2e_fq/csrc/include \
	      -gencode arch=compute_$$a,code=sm_$$a -c $$f -o /dev/null || exit 1; \
	  done; \
	done
	@stub=$$(mktemp -d) && mkdir -p $$stub/c10/cuda/impl && : > $$stub/c10/cuda/impl/cuda_cmake_macros.h && \
	flags="$$($(PY) -c 'import sysconfig; from torch.utils.cpp_extension import include_paths; print(" ".join("-I" + p for p in include_paths() + [sysconfig.get_paths()["include"]]))')" && \
	for f in $$(find pt2e_fq/csrc/cuda -name '*.cpp'); do \
	  echo "c++ -fsyntax-only $$f"; \
	  $(CXX) -std=c++20 -fsyntax-only -I$$stub $$flags -I$(CUDA_HOME)/include \
	    -Ipt2e_fq/csrc/include -Ipt2e_fq/csrc/common $$f || exit 1; \
	done; rm -rf $$stub

clean:
	rm -rf build $(VENV) *.egg-info pt2e_fq/*.so
