# Ballast: top-level entry points. `make demo` and `make test` install what they
# need (Debian 12 packages), build, and run; both are idempotent.
BUILD_DIR ?= build
BUILD_TYPE ?= RelWithDebInfo
PREFIX ?= /usr/local
JOBS ?= $(shell nproc)
FUZZ_DIR ?= build-fuzz
FUZZ_SECONDS ?= 60
CTEST_ARGS ?=

.PHONY: all deps configure build k8s-binaries torch2 downloads test-prep test-setup test-wheels ray ray-train wheel test unit integration kubernetes slurm demo install bench fuzz clean

all: build

deps:
	@scripts/install-deps.sh

$(BUILD_DIR)/build.ninja: CMakeLists.txt | deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DCMAKE_INSTALL_PREFIX=$(PREFIX) $(CMAKE_ARGS)

configure: deps $(BUILD_DIR)/build.ninja

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# The Kubernetes control plane the tests run against, helm (the chart's tests)
# and Kueue (the queueing tests), built from the Go module proxy into
# ~/.cache/ballast/k8s-<versions>, helm-<version> and kueue-<version>
# (10-20 min once; instant after), and KubeRay's CRDs (the RayJob example's
# test; downloaded, seconds) into kuberay-crds-<version>.
k8s-binaries:
	@scripts/k8s/build-control-plane.sh >/dev/null
	@scripts/k8s/build-helm.sh >/dev/null
	@scripts/k8s/build-kueue.sh >/dev/null
	@scripts/k8s/kuberay-crds.sh >/dev/null

# The pinned torch 2.x runtime the tests also run on: a venv of PyPI's torch
# in ~/.cache/ballast/torch-<version>-py<python> (~5 GB, minutes once;
# instant after).
torch2:
	@scripts/torch2-venv.sh >/dev/null

# What the tests install, as users do (scripts/build-wheels.sh): the cp311 wheel
# into the torch 2.x suites' venv ($(BUILD_DIR)/venv-torch2), the cp312 wheel
# into test_wheel's fresh CPython 3.12 venv (torch for 3.12 cached beside the
# first). The C++ core is ccache hits after `make build`: a few minutes.
test-wheels: build torch2
	@scripts/build-wheels.sh --out $(BUILD_DIR)/wheels --work $(BUILD_DIR)/wheel-build 3.11 3.12 >/dev/null
	@scripts/torch2-venv.sh --python 3.12 >/dev/null
	@scripts/torch2-wheel-venv.sh $(BUILD_DIR) >/dev/null

# Ray from PyPI, pinned (scripts/ray-venv.sh: ~/.cache/ballast/ray-<version>-py3.11,
# ~45 s once), seen by the Ray tests' venvs: $(BUILD_DIR)/venv-ray (Debian's
# torch 1.13) and the torch 2.x suites' venv.
ray: test-wheels
	@scripts/ray-test-venvs.sh $(BUILD_DIR) >/dev/null

# What the tests download, cached under versioned names (instant once cached):
# the torch 2.x venvs for CPython 3.11 and 3.12, the Ray venv and the container
# tests' Debian base (debootstrap). Mostly network and disk, so `make test`
# runs it beside the C++ and Go builds, which take the cores.
downloads:
	@scripts/torch2-venv.sh >/dev/null
	@scripts/torch2-venv.sh --python 3.12 >/dev/null
	@scripts/ray-venv.sh >/dev/null
	@scripts/container-base.sh >/dev/null

# Everything the tests need but the Go builds: the downloads overlap the C++
# build (make -j2 of the two groups); the wheels and the test venvs come after
# both. test-setup adds the Go builds (make -j3), for the targets below that
# run one label.
test-prep: deps
	@$(MAKE) --no-print-directory -j2 build downloads
	@$(MAKE) --no-print-directory test-wheels ray

test-setup: deps
	@$(MAKE) --no-print-directory -j3 build k8s-binaries downloads
	@$(MAKE) --no-print-directory test-wheels ray

# Ray Train's side of bench/ray_bench.py (not needed by the tests).
ray-train:
	@scripts/ray-train-venv.sh

# `pip install`-able wheels for CPython 3.10-3.13 and the sdist, in dist/.
wheel: deps
	scripts/build-wheels.sh --out dist --work $(BUILD_DIR)/wheel-build --sdist

# The Go builds (k8s-binaries) go on in the background at idle priority while
# test-prep runs and then the suites that run one at a time (label serial);
# the rest of the tests (unit, Slurm, Kubernetes) come after them
# (scripts/make-test.sh). CTEST_ARGS go to both ctest runs.
test:
	@scripts/make-test.sh $(BUILD_DIR) $(JOBS) $(CTEST_ARGS)

unit: build torch2 test-wheels ray
	cd $(BUILD_DIR) && ctest --output-on-failure -L unit -j $(JOBS)

integration: test-setup
	cd $(BUILD_DIR) && ctest --output-on-failure -L integration $(CTEST_ARGS)

kubernetes: build k8s-binaries
	cd $(BUILD_DIR) && ctest --output-on-failure -L kubernetes $(CTEST_ARGS)

slurm: build
	cd $(BUILD_DIR) && ctest --output-on-failure -L slurm $(CTEST_ARGS)

demo: build
	BALLAST_BIN=$(BUILD_DIR)/bin/ballast /usr/bin/python3 examples/demo.py

bench: build
	/usr/bin/python3 bench/recovery_bench.py --ballast $(BUILD_DIR)/bin/ballast
	/usr/bin/python3 bench/rendezvous_bench.py --ballast $(BUILD_DIR)/bin/ballast
	PYTHONPATH=$(BUILD_DIR)/python /usr/bin/python3 bench/ckpt_bench.py
	/usr/bin/python3 bench/precheck_bench.py --ballast $(BUILD_DIR)/bin/ballast
	PYTHONPATH=$(BUILD_DIR)/python /usr/bin/python3 bench/health_bench.py --ballast $(BUILD_DIR)/bin/ballast

# libFuzzer targets (parsers of user input, the master's journal, the
# checkpoint reader), built with clang and ASan in $(FUZZ_DIR), each run for
# FUZZ_SECONDS from the seeds the replay tests write. Their replay tests run in
# every `make test`.
fuzz: build
	@scripts/install-deps.sh clang-14 libclang-rt-14-dev
	cmake -S . -B $(FUZZ_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++-14 -DBALLAST_FUZZ=ON
	cmake --build $(FUZZ_DIR) -j $(JOBS) --target parser_fuzz master_journal_fuzz ckpt_reader_fuzz
	scripts/fuzz.sh $(BUILD_DIR) $(FUZZ_DIR) $(FUZZ_SECONDS)

install: build
	cmake --install $(BUILD_DIR)

clean:
	rm -rf $(BUILD_DIR) $(FUZZ_DIR)
