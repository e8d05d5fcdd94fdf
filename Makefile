# torch_stage: every task from a clean clone on a fresh machine.
#
#   make demo    set up, build, run the demonstration (a table and advice;
#                its figures and a trace go to build/demo/)
#   make report  the page of pictures (build/report/index.html) from what
#                make demo and make bench left in build/, with the plan of
#                torchvision's GoogLeNet (drawn in the zoo venv)
#   make test    set up, build, run the C++ (ctest) and Python (pytest) tests
#   make build   build the extension and the C++ tests (quick when up to date)
#   make docs    the reference docs (Sphinx: the guide in docs/, a page per
#                public name from its docstring) into build/docs
#   make wheel   a wheel built against the venv's torch, into dist/
#   make wheel-check  that wheel installed into a fresh venv with the same
#                torch: import, the backend found through its entry point,
#                python -m torch_stage.info, a staged loop (CI runs it)
#   make lint    clang-format check and ruff
#   make format  apply clang-format and ruff format
#   make tsan    torch-free C++ units and tests under ThreadSanitizer
#   make asan    the same under AddressSanitizer (+ UndefinedBehaviorSanitizer)
#   make bench   the benchmarks (JSON on stdout and in build/bench/)
#   make bench-tf the records pipeline side by side with tf.data on the same
#                files (tables), TensorFlow (tensorflow-cpu) in a venv of
#                its own, .venv-tf: an optional benchmark dependency only
#   make torture the reliability suite, full profile (tests/reliability/;
#                make test runs its quick profile)
#   make zoo     multi-stream on torchvision's models under the stream
#                sanitizer, in a venv of its own (torch 2.14.1 + torchvision)
#   make gpu-check  on a CUDA machine: the `cuda` tests, again under
#                TORCH_CUDA_SANITIZER=1, the zoo on real streams, the demo,
#                the multi-stream and device staging benchmarks, with GPU_PYTHON (default
#                python3, a CUDA build of torch; no venv), logs in
#                build/gpu-check/ (tests/gpu_check.sh)
#
# Set-up is part of every target: a .venv with TORCH_SPEC and the test
# dependencies, and GoogleTest and zlib (Debian's libgtest-dev, zlib1g-dev)
# when they are missing; tests and the report also need graphviz's dot and
# a headless browser (Debian's graphviz, chromium).

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
.DEFAULT_GOAL := test

PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BUILD := build
CPP_BUILD := $(BUILD)/cpp
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
export MAX_JOBS ?= $(JOBS)
# cmake, ninja and the tools installed in the venv come first.
export PATH := $(abspath $(VENV))/bin:$(PATH)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

DEPS_STAMP := $(VENV)/.deps-stamp
EXT_STAMP := $(BUILD)/.ext-stamp
EXT_SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h') setup.py pyproject.toml
CPP_SOURCES := $(shell find csrc tests/cpp tests/zoo_torchvision/cpp benchmarks/cpp examples -name '*.cpp' -o -name '*.h' 2>/dev/null)
CMAKE_FILES := CMakeLists.txt $(shell find tests/cpp benchmarks/cpp examples -name CMakeLists.txt)
PYTEST_ARGS ?=
, := ,

.PHONY: all setup venv gtest tools build cpp test demo report pictures docs wheel wheel-check lint format tsan asan bench bench-tf torture zoo gpu-check clean distclean

all: test

setup: venv gtest tools

# Reinstall when TORCH_SPEC differs from the one the venv was made with.
ifneq ($(shell cat $(DEPS_STAMP) 2>/dev/null),$(TORCH_SPEC))
.PHONY: $(DEPS_STAMP)
endif

venv: $(DEPS_STAMP)

$(DEPS_STAMP): requirements-dev.txt
	@test -x $(PY) || { echo "creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	$(PIP) install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PIP) install -q --disable-pip-version-check -r requirements-dev.txt "$(TORCH_SPEC)"
	@echo "$(TORCH_SPEC)" > $@

gtest:
	@if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then \
	  echo "GoogleTest is missing: installing Debian's libgtest-dev"; \
	  $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q libgtest-dev; \
	fi
	@if [ ! -f /usr/include/zlib.h ]; then \
	  echo "zlib headers are missing: installing Debian's zlib1g-dev"; \
	  $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q zlib1g-dev; \
	fi
	@command -v cmake > /dev/null || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q cmake; }

# graphviz draws stream plans (torch_stage.observe.report); chromium renders the
# report page in tests/observe/test_report.py.
tools:
	@command -v dot > /dev/null || { echo "graphviz's dot is missing: installing Debian's graphviz"; \
	  $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends graphviz; }
	@command -v chromium > /dev/null || { echo "chromium is missing: installing Debian's chromium"; \
	  $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends chromium; }

build: venv gtest $(EXT_STAMP) cpp

# The editable install registers the package (and its entry points) and
# builds the library in place; ninja recompiles only what changed.
$(EXT_STAMP): $(DEPS_STAMP) $(EXT_SOURCES)
	$(PIP) install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	@mkdir -p $(BUILD) && touch $@

$(CPP_BUILD)/build.ninja: $(CMAKE_FILES) $(DEPS_STAMP)
	cmake -S . -B $(CPP_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_PREFIX_PATH="$$($(PY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
	  -DPython_EXECUTABLE=$(abspath $(PY)) -Wno-dev > $(BUILD)/cmake-configure.log \
	  || { cat $(BUILD)/cmake-configure.log; exit 1; }

cpp: $(EXT_STAMP) $(CPP_BUILD)/build.ninja
	cmake --build $(CPP_BUILD) -j $(JOBS)

test: build tools
	@rc=0; \
	echo "== GoogleTest (ctest) =="; \
	ctest --test-dir $(CPP_BUILD) --output-on-failure --no-tests=error -j $(JOBS) \
	  2>&1 | tee $(BUILD)/ctest.log || rc=1; \
	echo "== pytest =="; \
	$(PY) -m pytest $(PYTEST_ARGS) 2>&1 | tee $(BUILD)/pytest.log || rc=1; \
	echo "== summary =="; \
	echo "ctest:  $$(grep -E 'tests passed|No tests were found' $(BUILD)/ctest.log | tail -1)"; \
	echo "pytest: $$(tail -1 $(BUILD)/pytest.log)"; \
	exit $$rc

demo: build
	$(PY) examples/demo.py --out $(BUILD)/demo

# Warnings are errors, as in tests/test_docs.py.
docs: build
	$(PY) -m sphinx -W --keep-going -b html docs $(BUILD)/docs
	@echo "the docs: $(BUILD)/docs/index.html"

# The wheel is built against the venv's torch (TORCH_SPEC): its libraries
# link that torch's, so it installs beside that torch release. Same torch,
# same flags as `make build`: its objects (build/temp) are reused.
WHEEL_VENV ?= $(BUILD)/wheel-venv
wheel: venv gtest
	rm -rf dist
	$(PIP) wheel -q --disable-pip-version-check --no-build-isolation --no-deps . -w dist
	@ls dist/*.whl

wheel-check: wheel
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(WHEEL_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps dist/*.whl
	cd $(WHEEL_VENV) && bin/python $(abspath tests/wheel_check.py)

# Every scenario in a process of its own under a hard timeout; one line each
# and a closing "N passed, M failed". TORTURE_ARGS: e.g. -k signals --json f.
TORTURE_ARGS ?=
torture: build
	$(PY) tests/reliability/run.py --profile full $(TORTURE_ARGS)

# record_pipeline generates its ~215 MB of seed files once, into
# build/bench_data/ (never part of `make test`).
bench: build
	$(PY) benchmarks/cores.py --json $(BUILD)/bench/cores.json
	$(PY) benchmarks/buffer_throughput.py --json $(BUILD)/bench/buffer_throughput.json
	$(PY) benchmarks/overlap.py --json $(BUILD)/bench/overlap.json
	$(PY) benchmarks/record_pipeline.py --json $(BUILD)/bench/record_pipeline.json
	$(PY) benchmarks/records_vs_tf_data.py --json > $(BUILD)/bench/records_vs_tf_data.json
	$(CPP_BUILD)/benchmarks/cpp/records_bench --layout columns --json $(BUILD)/bench/records_bench.json
	$(PY) benchmarks/multi_stream.py --json $(BUILD)/bench/multi_stream.json
	$(PY) benchmarks/compile_backends.py --json $(BUILD)/bench/compile_backends.json
	$(PY) benchmarks/dataloader_per_batch.py --json $(BUILD)/bench/dataloader_per_batch.json
	$(PY) benchmarks/dataloader_grid.py --json $(BUILD)/bench/dataloader_grid.json

# tf.data beside the records pipeline (benchmarks/records_vs_tf_data.py, and
# record_pipeline.py's tf.data column). TensorFlow is never a test
# dependency: it lives in its own venv, run as a subprocess by the
# benchmarks. BENCH_TF_ARGS: e.g. --rounds 9 --json.
TF_VENV ?= .venv-tf
TF_SPEC ?= tensorflow-cpu==2.21.0
TF_PY := $(TF_VENV)/bin/python
TF_STAMP := $(TF_VENV)/.deps-stamp
BENCH_TF_ARGS ?=

ifneq ($(shell cat $(TF_STAMP) 2>/dev/null),$(TF_SPEC))
.PHONY: $(TF_STAMP)
endif

$(TF_STAMP):
	@test -x $(TF_PY) || { echo "creating $(TF_VENV)"; $(PYTHON) -m venv $(TF_VENV); }
	$(TF_PY) -m pip install -q --disable-pip-version-check "$(TF_SPEC)"
	@echo "$(TF_SPEC)" > $@

bench-tf: build $(TF_STAMP)
	$(PY) benchmarks/records_vs_tf_data.py --layout packed --tf-python $(TF_PY) $(BENCH_TF_ARGS)
	$(PY) benchmarks/records_vs_tf_data.py --layout columns --tf-python $(TF_PY) $(BENCH_TF_ARGS)
	$(PY) benchmarks/record_pipeline.py --tf-python $(TF_PY)

# The torchvision zoo (tests/zoo_torchvision). PyPI's torchvision does not
# load beside the CPU build of torch 2.13 that the main venv pins, so the zoo
# has a venv of its own with a torch/torchvision pair that loads together,
# torch_stage installed into it (not in place: its objects are built against
# that torch, in a build folder of their own), and runs from outside the
# source tree's package.
ZOO_VENV ?= .venv-zoo
ZOO_TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
ZOO_PY := $(ZOO_VENV)/bin/python
ZOO_STAMP := $(ZOO_VENV)/.deps-stamp
ZOO_EXT_STAMP := $(BUILD)/.zoo-ext-stamp

$(ZOO_STAMP): requirements-dev.txt
	@test -x $(ZOO_PY) || { echo "creating $(ZOO_VENV)"; $(PYTHON) -m venv $(ZOO_VENV); }
	$(ZOO_PY) -m pip install -q --disable-pip-version-check $(ZOO_TORCH_SPEC)
	$(ZOO_PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt $(ZOO_TORCH_SPEC)
	@echo "$(ZOO_TORCH_SPEC)" > $@

$(ZOO_EXT_STAMP): $(ZOO_STAMP) $(EXT_SOURCES) $(shell find torch_stage -name '*.py')
	TORCH_STAGE_BUILD_TEMP=$(abspath $(BUILD))/zoo-temp \
	  $(ZOO_PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps .
	@mkdir -p $(BUILD) && touch $@

# The C++ runner that loads the scripted zoo models with LibTorch alone,
# compiled against the zoo venv's torch with the flags torch's own
# cpp_extension uses: that torch is a CUDA build, whose CMake package insists
# on a CUDA toolkit, and the runner needs none.
ZOO_RUNNER := $(BUILD)/zoo-cpp/run_scripted
ZOO_RUNNER_SRC := tests/zoo_torchvision/cpp/run_scripted.cpp

$(ZOO_RUNNER): $(ZOO_STAMP) $(ZOO_RUNNER_SRC)
	@mkdir -p $(@D)
	$(CXX) -O2 -o $@ $(ZOO_RUNNER_SRC) $$($(ZOO_PY) -c "import torch; \
	  from torch.utils import cpp_extension as c; lib = c.library_paths()[0]; \
	  print(' '.join(['-std=c++20', '-D_GLIBCXX_USE_CXX11_ABI=%d' % torch._C._GLIBCXX_USE_CXX11_ABI] \
	  + ['-I' + p for p in c.include_paths()] \
	  + ['-L' + lib, '-Wl,-rpath,' + lib, '-ltorch', '-ltorch_cpu', '-lc10', '-ldl']))")

zoo: gtest $(ZOO_EXT_STAMP) $(ZOO_RUNNER)
	cd tests && TORCH_STAGE_ZOO_RUNNER=$(abspath $(ZOO_RUNNER)) \
	  ../$(ZOO_VENV)/bin/python -m pytest -p no:cacheprovider --rootdir=.. \
	  -c ../pyproject.toml zoo_torchvision $(PYTEST_ARGS)

# Not part of CI (no GPU there). Its own python3 and no set-up: GPU
# machines here reach no package index.
GPU_CHECK_SECONDS ?= 585
gpu-check:
	bash tests/gpu_check.sh $(BUILD)/gpu-check $(GPU_CHECK_SECONDS)

# The report page. torchvision (GoogLeNet's plan) loads only in the zoo venv,
# so the page is drawn there, from outside the source tree like the zoo; the
# demo's trace and the benchmarks' JSON come from build/ whichever venv made
# them. Without a make demo first, the page has the plan and benchmarks only.
REPORT_ARGS ?=
report: tools $(ZOO_EXT_STAMP)
	@test -f $(BUILD)/demo/demo.json || echo "no build/demo/demo.json: run make demo first for the staged run's pictures"
	cd $(BUILD) && ../$(ZOO_PY) -m torch_stage.observe.report --from . -o report/index.html $(REPORT_ARGS)

# The two pictures in README.md (docs/), from the report command.
pictures: tools $(ZOO_EXT_STAMP)
	cd $(BUILD) && ../$(ZOO_PY) -m torch_stage.observe.report --from . -o pictures/index.html \
	  --no-bench --plan-max-nodes 31 --timeline-items 8
	cp $(BUILD)/pictures/timeline.png $(BUILD)/pictures/plan.png docs/

PY_FILES := setup.py docs/conf.py torch_stage tests benchmarks examples

lint: venv
	@command -v clang-format > /dev/null || { echo "clang-format is missing: installing Debian's clang-format"; \
	  $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends clang-format; }
	clang-format --dry-run --Werror $(CPP_SOURCES)
	ruff check $(PY_FILES)
	ruff format --check $(PY_FILES)

format: venv
	@command -v clang-format > /dev/null || { $(SUDO) apt-get update -q && \
	  $(SUDO) apt-get install -y -q --no-install-recommends clang-format; }
	clang-format -i $(CPP_SOURCES)
	ruff check --fix $(PY_FILES)
	ruff format $(PY_FILES)

# The torch-free units (bounded buffer, records, scheduler) and their tests, built
# under a sanitizer; torch itself is not instrumented, so it stays out.
define sanitize
	cmake -S . -B $(BUILD)/$(1) -G Ninja -DTORCH_STAGE_PURE_ONLY=ON \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS="$(2) -fno-omit-frame-pointer" \
	  -Wno-dev > $(BUILD)/$(1)-configure.log || { cat $(BUILD)/$(1)-configure.log; exit 1; }
	cmake --build $(BUILD)/$(1) -j $(JOBS)
	ctest --test-dir $(BUILD)/$(1) --output-on-failure --no-tests=error
endef

tsan: gtest
	@mkdir -p $(BUILD)
	$(call sanitize,tsan,-fsanitize=thread)

asan: gtest
	@mkdir -p $(BUILD)
	$(call sanitize,asan,-fsanitize=address$(,)undefined -fno-sanitize-recover=undefined)

clean:
	rm -rf $(BUILD) dist docs/generated torch_stage/lib torch_stage/*.so

distclean: clean
	rm -rf $(VENV) $(ZOO_VENV) $(TF_VENV) *.egg-info
