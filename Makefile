# The fork's commands. `make demo` and `make test` work on a fresh clone: they create .venv themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# the fork's two distributions: lightning (this folder) and the standalone pytorch-lightning (built from the same
# patches and modules, renamed); and the tests' unpatched stock 2.6.6, renamed to stock_pytorch_lightning
FORK := . ./packaging/pytorch-lightning
STOCK_WHEEL := $(VENV)/stock-wheel
# Always this torch: a plain `pip install torch` pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0
# torch < 2.4 wheels were built against numpy 1 (with numpy 2, `torch.from_numpy`/`.numpy()` raise "Numpy is not available")
NUMPY := $(if $(filter torch==2.1 torch==2.1.% torch==2.2 torch==2.2.% torch==2.3 torch==2.3.%,$(TORCH)),numpy<2)
# The torch matrix (issue 13): the oldest torch lightning 2.6.6 declares and the newest this machine's pip allows,
# each in its own virtual environment. Their PyPI builds are CUDA builds (~2.5 GB) that run fine on a CPU.
OLDEST_TORCH ?= torch==2.1.2
NEWEST_TORCH ?= torch==2.14.1
# What `make test` runs; the matrix leaves out tests/tests_forkbuild (the build's tests do not depend on torch, and are slow)
TESTS ?= tests
MATRIX_TESTS ?= tests/tests_pytorch tests/tests_fabric tests/tests_docs
# 1: `make test` runs the behaviour tests a second time, renamed for the standalone import names (issue 15); by
# default only when it runs every test (TESTS=tests), so the matrix and a TESTS= selection run them once
STANDALONE_NAMES ?= $(if $(filter tests,$(TESTS)),1,0)
PYTEST_ARGS ?=
BENCH_ARGS ?=
UPSTREAM ?=
BRANCH ?=
REF ?= 2.6.5
UPSTREAM_TEST_ARGS ?=
FORCE ?=

SERIES_TESTS ?= all
.PHONY: setup install test mutation-check series-check test-oldest-torch test-newest-torch test-matrix demo docs bench pr-stack upstream-test tree tree-standalone export wheel clean

$(VENV)/.deps: requirements/test.txt requirements/docs.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)" $(if $(NUMPY),"$(NUMPY)") -r requirements/test.txt
	$(PY) -m pip install --quiet $(FORK)
	touch $@

## setup: the virtual environment with torch, the test tools and the fork built from this checkout
setup: $(VENV)/.deps install

install: $(VENV)/.deps
	@$(PY) -c 'import sys, torch; want = "$(TORCH)".partition("==")[2]; have = torch.__version__.split("+")[0];\
	  sys.exit(None if want in ("", have) else f"$(VENV) holds torch {have}, not $(TORCH): give each torch its own VENV=")'
	$(PY) -m pip install --quiet --force-reinstall --no-deps --no-build-isolation $(FORK)
	rm -rf $(STOCK_WHEEL)
	$(PY) -m forkbuild wheel --flavour stock-pytorch-lightning -o $(STOCK_WHEEL) >/dev/null
	$(PY) -m pip install --quiet --force-reinstall --no-deps $(STOCK_WHEEL)/*.whl
	$(PY) -m pip check

## test: every test of the repository, against the fork as installed from this checkout; then the behaviour tests
##       again under the standalone names (pytorch_lightning, lightning_fabric), renamed into build/standalone-tests
test: setup
	$(PY) -m pytest $(TESTS) $(PYTEST_ARGS)
ifeq ($(STANDALONE_NAMES),1)
	$(PY) -m forkbuild standalone-tests -o build/standalone-tests
	$(PY) -m pytest -c build/standalone-tests/pytest.ini build/standalone-tests $(PYTEST_ARGS)
endif

## test-oldest-torch / test-newest-torch: the behaviour and docs tests on torch 2.1.2 / 2.14.1 (.venv-torch2.1, .venv-torch2.14);
##        any other torch: make test TORCH=torch==2.4.1 VENV=.venv-torch2.4 TESTS="tests/tests_pytorch tests/tests_fabric tests/tests_docs"
test-oldest-torch:
	$(MAKE) test TORCH="$(OLDEST_TORCH)" VENV=.venv-torch2.1 TESTS="$(MATRIX_TESTS)"

test-newest-torch:
	$(MAKE) test TORCH="$(NEWEST_TORCH)" VENV=.venv-torch2.14 TESTS="$(MATRIX_TESTS)"

## test-matrix: both ends of the torch matrix (the default torch is `make test`)
test-matrix: test-oldest-torch test-newest-torch

## mutation-check: take each mechanism of the fork out (tests/mutation_check.py) and check that a test fails
mutation-check: setup
	$(PY) tests/mutation_check.py

## demo: the fork against PyTorch's AMP recipe in 32 / bf16-mixed / 16-mixed, manual and automatic; its own lighter
##       setup: torch, the fork and stock 2.6.6 built from this checkout, matplotlib, and pytest for the tests' oracle
##       the demo runs through (tests/amp_oracle; no docs tools)
$(VENV)/.demo-deps: requirements/demo.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)" $(if $(NUMPY),"$(NUMPY)") -r requirements/demo.txt
	touch $@

demo: $(VENV)/.demo-deps
	$(PY) -m pip install --quiet $(FORK)
	rm -rf $(STOCK_WHEEL)
	$(PY) -m forkbuild wheel --flavour stock-pytorch-lightning -o $(STOCK_WHEEL) >/dev/null
	$(PY) -m pip install --quiet --force-reinstall --no-deps $(STOCK_WHEEL)/*.whl
	$(PY) examples/amp_demo.py

## docs: the fork's documentation pages as HTML (build/docs/html), and every example on them run
docs: setup
	$(PY) -m sphinx -W --keep-going -q -b html docs/fork build/docs/html
	$(PY) tests/tests_docs/doc_examples.py
	@echo "HTML: build/docs/html/index.html (mixed precision in manual optimization: build/docs/html/model/manual_optimization.html)"

## bench: the fork against stock lightning 2.6.6 and a hand-written PyTorch loop, as ratios -> benchmarks/results/
##        (on a CUDA machine: make bench BENCH_ARGS="--device cuda")
bench:
	TORCH="$(TORCH)" PYTHON="$(PYTHON)" bash benchmarks/setup.sh
	benchmarks/.venvs/fork/bin/python benchmarks/run.py $(BENCH_ARGS)

# gpu-check's environment: `make setup` with a CUDA build of torch (PyPI's torch 2.14.1 is one), in the torch matrix's
# venv of that torch; GPU_PYTHON=<interpreter> skips the setup and runs the check there (fork, stock copy and torch in it)
GPU_TORCH ?= $(NEWEST_TORCH)
GPU_VENV ?= .venv-torch2.14
GPU_PYTHON ?=
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
## gpu-check: on a machine with one CUDA GPU, the fork against stock 2.6.6 and torch's AMP recipe on CUDA (the two user
##   reports, equivalence, cost per step, the misuse watch) in at most 8 minutes -> artifacts/gpu-check.md and .json;
##   without CUDA it says so in one line and exits 0 (benchmarks/gpu_check_report.py: the report's format)
gpu-check:
	@if $(PYTHON) benchmarks/gpu_check.py --probe; then \
	  $(if $(GPU_PYTHON),,$(MAKE) setup TORCH="$(GPU_TORCH)" VENV="$(GPU_VENV)" && ) \
	  $(or $(GPU_PYTHON),$(GPU_VENV)/bin/python) benchmarks/gpu_check.py $(GPU_CHECK_ARGS); \
	fi

## pr-stack: the stack of small upstream PRs (upstream/stack/<NN>-<slug>/), one branch each in UPSTREAM on upstream
##   master 7f0c343 (BASE=<commit> for a tree exported from it) alone, and each merged in merge order onto its
##   predecessors (branch amp/stack-in-order); checks each PR's limits (400/600/300 changed lines under src/tests/docs)
##   and writes build/pr-stack/stack.json; the clone is left as it was (FORCE=1 replaces the stack's branches that exist)
pr-stack:
	@test -n "$(UPSTREAM)" || { echo "usage: make pr-stack UPSTREAM=<git work tree of upstream master> [BASE=<commit>] [FORCE=1]" >&2; exit 2; }
	$(PYTHON) -m upstream.pr_stack --upstream "$(UPSTREAM)" $(if $(BASE),--base "$(BASE)") $(if $(FORCE),--force)

## series-check: the series reviewable one concern at a time: every own file claimed by its patch, each patch's
##   Forwarded: pointing where its concern went, no patch rewriting an earlier one (churn < 5%), every patch cited in
##   patches/, the Markdown and docs/ existing, and every prefix building, importing and passing the tests of the
##   concerns it holds (SERIES_TESTS=all; new: each test file once; none)
series-check: setup
	$(PY) -m forkbuild series-check --tests $(SERIES_TESTS)

## upstream-test: upstream's own tests against the installed fork (not in CI): stock lightning 2.6.6 vs the fork on
##   upstream's tests at REF (2.6.5: the last tag upstream's repository has) with the test patches, every failure on the
##   fork owned by a test patch or not (FULL=1: the whole CPU suites); STACK=1: each stack PR's tests on the fork;
##   BRANCH=<a stack branch in UPSTREAM>: that branch vs its base (BASE, default master) from source
upstream-test:
	@test -n "$(UPSTREAM)" || { echo "usage: make upstream-test UPSTREAM=<upstream Lightning clone> [REF=2.6.5] [FULL=1 | STACK=1 | BRANCH=<stack branch> [BASE=master]]" >&2; exit 2; }
	$(PYTHON) -m upstream.upstream_test --upstream "$(UPSTREAM)" \
	  $(if $(BRANCH),--branch "$(BRANCH)" $(if $(BASE),--base "$(BASE)"),--ref "$(REF)") $(if $(FULL),--full) \
	  $(if $(STACK),--stack) $(UPSTREAM_TEST_ARGS)

## tree / export: the patched upstream tree as a git history in .tree/, and back into patches/ and src/
tree:
	$(PYTHON) -m forkbuild tree --force

export:
	$(PYTHON) -m forkbuild export

## tree-standalone: `import pytorch_lightning` / `lightning_fabric` in $(VENV) from .tree/'s working files (edits
##        included, exported or not); an editable install imports `lightning` from .tree/ itself
tree-standalone:
	$(PY) -m forkbuild tree-standalone --install

## wheel: build dist/lightning-<version>+<label>-py3-none-any.whl and dist/pytorch_lightning-<version>+<label>-...whl
wheel:
	$(PYTHON) -m forkbuild wheel -o dist

clean:
	rm -rf $(VENV) dist .tree
