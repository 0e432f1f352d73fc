# Two entry points for a fresh machine: `make train` and `make test` (`make check`: the inner loop).
# Both create .venv (Python >= 3.12, found by tools/setup/find_python.sh) when missing.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
ORACLE := .venv-oracle
ORACLE_PY := $(ORACLE)/bin/python
GPU_VENV := .venv-gpu
GPU_PY := $(GPU_VENV)/bin/python
# jax 0.11.2 (the lent GPU image's jax).
J11 := .venv-jax011
J11_PY := $(J11)/bin/python
# On jax 0.11.2: the tests marked `jax011`, each a test of what differs between the two jax
# versions (olmo_jax/compat.py: its shims, and the jax functions of its SAME_ON_BOTH: the
# Pallas Mosaic GPU kernels in interpret mode and lowered for CUDA, the CPU FFI kernels,
# jax.nn.scaled_matmul, shard_map's vma typing and pcast, ragged_all_to_all, the ring's
# ppermute and pair-exchange all_gather), forward and gradients, and every test of what runs on the image itself (marked
# `image`: gpu_check end to end, the image's packages), slow or not. The run fails unless
# its tests made olmo_jax call every one of those APIs (tests/jax011_apis.py);
# tests/test_jax011_selection.py keeps this list and the marks in step.
J11_TESTS ?= tests/kernels/test_cpu_attention.py tests/kernels/test_cpu_gmm.py \
  tests/kernels/test_grouped_matmul.py tests/kernels/test_grouped_matmul_tcgen05.py \
  tests/kernels/test_grouped_matmul_slots.py \
  tests/kernels/test_mxfp8_kernels.py tests/kernels/test_platform.py \
  tests/model/test_mxfp8_model.py tests/parallel/test_gpu_typing.py \
  tests/parallel/test_parallel_zero.py tests/parallel/test_parallel_dispatch.py \
  tests/parallel/test_context_attention.py tests/parallel/test_ring_window.py \
  tests/tools/test_gpu_check.py tests/trainer/test_image_packages.py
CONFIG ?= configs/tiny.py
ARGS ?=
PYTEST_ARGS ?=
GPU_PYTEST_ARGS ?= tests/gpu
# Test processes (pytest-xdist; whole files per process, so a module compiles its programs once).
TEST_WORKERS ?= 2
# The deviceless XLA:GPU compiles keep a process about half busy (2 AMD EPYC cores: the
# Blackwell run took 5:44 with 2 processes, 3:20 with 4), so tests/gpu runs 4.
GPU_TEST_WORKERS ?= 4
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
# Python writes the bytecode of each module it imports (__pycache__/, git-ignored) and
# later processes read it; an environment with PYTHONDONTWRITEBYTECODE set (this project's
# machines and CI set it) would make every process compile the sources it imports again:
# 4-6 CPU seconds a process for jax and olmo_jax, 6 more for torch in the oracle venv.
# Measured side by side, the main suite took 16:08 with it unset, 18:56 set (31 and 36
# CPU minutes on 2 AMD EPYC cores).
unexport PYTHONDONTWRITEBYTECODE
# The CPU test stages (main, jax 0.11.2, make check) compile with XLA's backend (LLVM)
# optimization level 0: the same HLO passes, fusions and buffers, less LLVM time (a third
# less wall time on tests/model's MoE and router files, measured side by side); the GPU
# stages keep the default. The golden curve's runs drop it (tools/testing/golden_curve.py).
CPU_TEST_XLA_FLAGS := $(XLA_FLAGS) --xla_backend_optimization_level=0
# Every test stage's processes (and their children) allocate with jemalloc where the
# machine has it (tools/setup/jemalloc.sh, preloaded; `make system-packages` installs it):
# XLA's compiler and runtime allocate and free at a rate at which glibc's malloc spent
# about a tenth of a mesh test's CPU time in its own code and another tenth zeroing the
# pages it had returned to the kernel and faulted in again. Measured one after the other
# on 2 AMD EPYC cores: tests/parallel/test_window_parallel.py 43.8 s -> 31.6 s, a mix of
# six main-suite files under -n 2 164 s -> 150 s, the Hopper GPU-compile stage 3:14 -> 2:35.
# tcmalloc did less (35.7 s on the first), as did jemalloc's THP and no-purge options.
TEST_MALLOC := LD_PRELOAD="$$(tools/setup/jemalloc.sh)$${LD_PRELOAD:+ $$LD_PRELOAD}"
# Without jemalloc, the CPU test stages' processes ask glibc's malloc to back its large
# blocks with transparent huge pages (glibc >= 2.35; where the kernel's THP mode is
# `madvise`, as here, nothing else does): XLA:CPU mmaps each block over 32 MB afresh, and
# first-touching it 4 KiB at a time was a fifth of the evals and context-parallel files'
# CPU time (measured side by side: 91 instead of 109 CPU seconds, system time 18 instead
# of 31; the golden curve's 8-device run 64 instead of 72).
CPU_TEST_ENV := $(TEST_MALLOC) GLIBC_TUNABLES=glibc.malloc.hugetlb=1 XLA_FLAGS="$(CPU_TEST_XLA_FLAGS)"
# pip installs with --no-compile: Python writes the .pyc of what is imported when it is
# first imported, instead of pip compiling every installed module up front (from a warm
# wheel cache, measured side by side: .venv 58 s instead of 123 s, .venv-jax011 11 s
# instead of 40 s).
# `make test` installs its four venvs side by side (make -j); their editable installs of this
# checkout write the same olmo_jax.egg-info, so those steps take turns under one lock
# (util-linux's flock; without it the venvs install one after another).
EDITABLE := $(if $(shell command -v flock),flock .editable-install.lock)
VENV_JOBS := $(if $(EDITABLE),-j4,-j1)

.PHONY: train test test-gpu check docs venv oracle jax011 gpu-venv gpu-wheels system-packages lint clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml tools/requirements/eval_data.txt
	@set -e; if [ ! -x $(PY) ]; then \
	  py=$$(tools/setup/find_python.sh); echo "creating $(VENV) with $$py"; \
	  $$py -m venv $(VENV); fi
	$(PY) -m pip install -q --no-compile --upgrade pip
	$(EDITABLE) $(PY) -m pip install -q --no-compile -e '.[dev,hf,tensorboard,wandb,docs,cloud,eval]'
	$(PY) -m pip install -q --no-compile --no-deps -r tools/requirements/eval_data.txt
	@$(PY) -c "from olmo_jax.kernels import cpu_ffi; w = cpu_ffi.available(); \
	  print('CPU FFI kernels (gmm_impl=blas, attention_impl=blas):', w or 'built')"
	@touch $@

# The transformers/torch oracle used only by parity tests (Python 3.11: the CPU torch wheel).
oracle: $(ORACLE)/.installed

$(ORACLE)/.installed: tools/requirements/oracle.txt tools/requirements/eval_data.txt
	@set -e; if [ ! -x $(ORACLE_PY) ]; then \
	  py=$$(tools/setup/find_python.sh --oracle); echo "creating $(ORACLE) with $$py"; \
	  $$py -m venv $(ORACLE); fi
	$(ORACLE_PY) -m pip install -q --no-compile --upgrade pip
	$(ORACLE_PY) -m pip install -q --no-compile -r tools/requirements/oracle.txt
	$(ORACLE_PY) -m pip install -q --no-compile --no-deps -r tools/requirements/eval_data.txt
	@touch $@

# XLA:GPU without a GPU (tests/gpu: the training step compiled for abstract H200/B300s):
# the project plus the few CUDA wheels a compile needs (tools/requirements/gpu.txt).
gpu-venv: $(GPU_VENV)/.installed

$(GPU_VENV)/.installed: pyproject.toml tools/requirements/gpu.txt
	@set -e; if [ ! -x $(GPU_PY) ]; then \
	  py=$$(tools/setup/find_python.sh); echo "creating $(GPU_VENV) with $$py"; \
	  $$py -m venv $(GPU_VENV); fi
	$(GPU_PY) -m pip install -q --no-compile --upgrade pip
	$(EDITABLE) $(GPU_PY) -m pip install -q --no-compile -e '.[dev]' -c tools/requirements/gpu.txt
	$(GPU_PY) -m pip install -q --no-compile --no-deps -r tools/requirements/gpu.txt
	@# cuDNN's execution engines only run kernels: a compile loads libcudnn.so.9 and libcudnn_graph.so.9.
	@d=$$($(GPU_PY) -c 'import nvidia.cudnn; print(list(nvidia.cudnn.__path__)[0])') && \
	  find $$d/lib -name 'libcudnn_*.so*' ! -name 'libcudnn_graph.so*' -delete && rm -rf $$d/include
	@touch $@

# olmo_jax on jax 0.11.2 with the flax/optax/orbax/chex of its day (tools/requirements/jax011.txt).
jax011: $(J11)/.installed

$(J11)/.installed: tools/requirements/jax011.txt pyproject.toml
	@set -e; if [ ! -x $(J11_PY) ]; then \
	  py=$$(tools/setup/find_python.sh --jax011); echo "creating $(J11) with $$py"; \
	  $$py -m venv $(J11); fi
	$(J11_PY) -m pip install -q --no-compile --upgrade pip
	$(J11_PY) -m pip install -q --no-compile -r tools/requirements/jax011.txt
	$(EDITABLE) $(J11_PY) -m pip install -q --no-compile --no-deps -e .
	@touch $@

# The wheels tools/gpu_check.sh carries to the lent H200 image (Python 3.12, x86-64) in the
# git-ignored .whl/: pinned in tools/requirements/gpu_wheels.txt and tools/requirements/gpu_wheels_torch.txt, no deps.
gpu-wheels: venv
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
	  -d .whl -r tools/requirements/gpu_wheels.txt -r tools/requirements/gpu_wheels_torch.txt
	@du -cb .whl/*.whl | tail -1 | awk '{printf "carried wheels in .whl/: %.1f MB\n", $$1 / 1e6}'

train: venv
	XLA_FLAGS= $(PY) -m olmo_jax.train --config=$(CONFIG) $(ARGS)

# The Debian packages the tests use, installed with apt-get when missing (as root):
# headless Chromium + chromedriver for the report's browser tests and the docs' link check
# (skipped where they cannot be installed), and jemalloc, which the test stages preload in
# place of glibc's malloc (TEST_MALLOC; without it they run on glibc's, slower).
system-packages:
	@missing=""; \
	  { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; } || missing=" chromium chromium-driver"; \
	  [ -n "$$(tools/setup/jemalloc.sh)" ] || missing="$$missing libjemalloc2"; \
	  if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	      echo "installing$$missing (report browser tests, the test stages' allocator)"; \
	      mkdir -p .artifacts; \
	      (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing) \
	        > .artifacts/apt-get.log 2>&1 || { tail -n 5 .artifacts/apt-get.log; \
	        echo "warning: could not install$$missing (.artifacts/apt-get.log): without chromium the" \
	             "browser tests are skipped, without libjemalloc2 the tests run on glibc's malloc (slower)"; }; \
	    else \
	      echo "warning:$$missing missing and not installable here (needs root and apt-get): without" \
	           "chromium the browser tests are skipped, without libjemalloc2 the tests run on glibc's malloc (slower)"; \
	    fi; \
	  fi

# A crashed test process ends its pytest run (--max-worker-restart=0: xdist's replacement
# of a crashed worker once left a --dist loadfile run waiting forever for the crashed
# file), with the crashed thread's stack in the test's failure report. When crashes were
# the run's only failures, tools/testing/pytest_resume.sh runs the tests that had not ended
# once more (tests/crash_resume.py): a segmentation fault in XLA:CPU's executable.serialize()
# (jax's write to the suite's compilation cache) has killed a worker about once in a few
# full runs, at a different test each time.
RESUME := tools/testing/pytest_resume.sh
# The suite in .venv (CPU), then the jax 0.11.2 subset in .venv-jax011, then tests/gpu in
# .venv-gpu (README: "Compiling for GPUs without one"), one stage after the other. Beside
# each other they cost more than in turn: on 2 AMD EPYC cores the main suite took 18:56
# alone and 30:56 with the GPU stages beside it, niced (which took 39:41, 6:53 alone); the
# CPU time of the whole run grew from about 52 to 78 minutes. The venvs install in
# parallel, each one's output printed when it is done. Each pytest run compiles through
# its own persistent compilation cache, a fresh folder shared by its workers and their
# child processes (tests/conftest.py; OLMO_JAX_TEST_CACHE=0 turns it off), so the jax
# 0.11.2 and GPU runs never read the main run's programs.
test:
	@mkdir -p .artifacts; date +%s > .artifacts/test-start
	@$(MAKE) --no-print-directory $(VENV_JOBS) --output-sync=target venv oracle jax011 gpu-venv system-packages || { \
	  echo "error: a venv could not be installed (see pip's message above): the tests cannot run" >&2; \
	  exit 1; }
	@$(MAKE) --no-print-directory docs
	@t0=$$(cat .artifacts/test-start); t1=$$(date +%s); \
	  mmss() { printf '%d:%02d' $$(( $$1 / 60 )) $$(( $$1 % 60 )); }; \
	  echo "main suite, then jax 0.11.2, then the GPU-compile stages"; \
	  $(CPU_TEST_ENV) $(RESUME) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0 --ignore=tests/gpu $(PYTEST_ARGS); \
	  main=$$?; j11=0; t2=$$(date +%s); \
	  if [ -n "$(strip $(J11_TESTS))" ]; then echo "jax 0.11.2 ($(J11)): $(J11_TESTS)"; \
	    $(CPU_TEST_ENV) $(RESUME) $(J11_PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0 \
	      -m "jax011 or image" -p tests.jax011_apis $(J11_TESTS); j11=$$?; fi; \
	  t3=$$(date +%s); $(MAKE) --no-print-directory test-gpu; rc=$$?; t4=$$(date +%s); \
	  echo "make test: set-up $$(mmss $$((t1 - t0))), main suite $$(mmss $$((t2 - t1))), jax 0.11.2" \
	    "$$(mmss $$((t3 - t2))), GPU-compile stages $$(mmss $$((t4 - t3))); total $$(mmss $$((t4 - t0)))"; \
	  if [ $$main != 0 ] || [ $$j11 != 0 ] || [ $$rc != 0 ]; then \
	    echo "make test: main suite exit $$main, jax 0.11.2 exit $$j11, GPU-compile stages exit $$rc" >&2; exit 1; fi

# The GPU-compile stages of `make test`, one after the other.
# One GPU architecture per process: once a process has assembled a Mosaic GPU kernel for
# one sm_XYa, ptxas refuses another's (sm_90a then sm_103a: "SM version specified by
# .target is higher than default SM version assumed"; sm_103a then sm_100a: "cannot be
# compiled to future architecture"), so Hopper, B200 (sm_100) and B300 (sm_103) compile
# in separate runs; tests/gpu/conftest.py refuses a selection that mixes them.
test-gpu:
	$(TEST_MALLOC) $(RESUME) $(GPU_PY) -m pytest -q -n $(GPU_TEST_WORKERS) $(GPU_PYTEST_ARGS) -k "not b200 and not b300"
	$(TEST_MALLOC) $(RESUME) $(GPU_PY) -m pytest -q -n $(GPU_TEST_WORKERS) $(GPU_PYTEST_ARGS) -k b200
	$(TEST_MALLOC) $(RESUME) $(GPU_PY) -m pytest -q -n $(GPU_TEST_WORKERS) $(GPU_PYTEST_ARGS) -k b300

# The docs site (mkdocs.yml) into the git-ignored site/; --strict fails on a broken link or anchor.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# The inner loop (meant to take < 8 min on 2 cores once the venvs are installed): lint, then
# the main suite's fast tier, every test not marked `slow` (tests/conftest.py SLOW).
check: lint
	$(CPU_TEST_ENV) $(RESUME) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0 --ignore=tests/gpu -m "not slow" $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check olmo_jax tests tools configs

clean:
	rm -rf $(VENV) $(ORACLE) $(J11) $(GPU_VENV) runs .pytest_cache .artifacts site
