# gpuvisor build.  `make` builds the interposer and the simulated driver
# with nothing but gcc and make.  See README.md for the two main commands.

CC      ?= gcc
BUILD   ?= build
PYTHON  ?= python3
VENV    ?= .venv

WARN    := -Wall -Wextra -Werror
BASEFL  := -std=c11 -D_GNU_SOURCE -fPIC -pthread -fvisibility=hidden -Inative/include -iquote native/shim \
           -include native/include/gv_glibc.h
OPT     ?= -O2 -g
CFLAGS_ALL = $(BASEFL) $(WARN) $(OPT) $(EXTRA_CFLAGS)
LDLIBS_ALL = -ldl -pthread $(EXTRA_LDFLAGS)

SHIM_SRCS := $(sort $(wildcard native/shim/*.c))
SIMCUDA_SRCS := $(sort $(wildcard native/sim/cuda_*.c native/sim/state_*.c))
SIMNVML_SRCS := $(sort $(wildcard native/sim/nvml_*.c native/sim/state_*.c))
SIM_HDRS := $(wildcard native/sim/*.h)
SHIM_HDRS := $(wildcard native/shim/*.h) $(wildcard native/include/*.h)
CTEST_SRCS := $(sort $(wildcard native/tests/t_*.c))
CTESTS := $(patsubst native/tests/%.c,$(BUILD)/tests/%,$(CTEST_SRCS))
# The tests' headers include the public ones (gv_cuda.h, gpuvisor.h), and so do
# the t_sim_* programs, whose rule names no other header.
CTEST_HDRS := $(wildcard native/tests/*.h) $(wildcard native/include/*.h)

# The release, written once: pyproject.toml's version (gv_version()).
GV_VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)

LIB      := $(BUILD)/libgpuvisor.so
SIMCUDA  := $(BUILD)/sim/libcuda.so.1
SIMNVML  := $(BUILD)/sim/libnvidia-ml.so.1

.PHONY: all lib sim ctests asan tsan venv test test-fast bench demo lint clean k8s protos
all: lib sim ctests

lib: $(LIB)
sim: $(SIMCUDA) $(SIMNVML)
ctests: $(CTESTS)

$(LIB): $(SHIM_SRCS) $(SHIM_HDRS) pyproject.toml
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -DGV_DEFINES_DLSYM -DGV_VERSION='"$(GV_VERSION)"' -Wl,--build-id -shared -Wl,-soname,libgpuvisor.so -o $@ $(SHIM_SRCS) $(LDLIBS_ALL)

# The simulated driver is linked like the real one: -Bsymbolic, so its own
# internal calls never reach an interposer.
$(SIMCUDA): $(SIMCUDA_SRCS) $(SIM_HDRS) native/include/gv_cuda.h native/include/gv_glibc.h
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -Inative/sim -shared -Wl,-Bsymbolic -Wl,-soname,libcuda.so.1 -o $@ $(SIMCUDA_SRCS) $(LDLIBS_ALL) -lrt
	ln -sf libcuda.so.1 $(BUILD)/sim/libcuda.so

$(SIMNVML): $(SIMNVML_SRCS) $(SIM_HDRS) native/include/gv_cuda.h native/include/gv_glibc.h
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -Inative/sim -shared -Wl,-Bsymbolic -Wl,-soname,libnvidia-ml.so.1 -o $@ $(SIMNVML_SRCS) $(LDLIBS_ALL) -lrt
	ln -sf libnvidia-ml.so.1 $(BUILD)/sim/libnvidia-ml.so

# C test programs.  Programs named t_link_* link against the (simulated)
# driver with -lcuda -lnvidia-ml, like an ordinary CUDA program; the rest
# dlopen what they need.
$(BUILD)/tests/t_link_%: native/tests/t_link_%.c $(CTEST_HDRS) $(SIMCUDA) $(SIMNVML)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -Inative/tests -o $@ $< -L$(BUILD)/sim -lcuda -lnvidia-ml $(LDLIBS_ALL)

# Unit tests of the region code link its sources directly.
$(BUILD)/tests/t_region_%: native/tests/t_region_%.c $(CTEST_HDRS) $(SHIM_SRCS) $(SHIM_HDRS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -Inative/tests -o $@ $< $(wildcard native/shim/region_*.c) native/shim/file_space.c native/shim/log.c native/shim/limits.c native/shim/api.c $(LDLIBS_ALL)

# The SM meter's calibration is plain arithmetic: its unit test links it alone.
$(BUILD)/tests/t_sm_calib: native/tests/t_sm_calib.c native/shim/sm_calib.c $(CTEST_HDRS) $(SHIM_HDRS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -Inative/tests -o $@ $< native/shim/sm_calib.c $(LDLIBS_ALL) -lm

# So are the launch order between containers and the enqueue word, with
# stand-ins for the rest.
ARB_TEST_SRCS := native/shim/sm_arbiter.c native/shim/sm_enqueue.c native/shim/node_file.c native/shim/file_space.c
$(BUILD)/tests/t_sm_arbiter: native/tests/t_sm_arbiter.c $(ARB_TEST_SRCS) $(CTEST_HDRS) $(SHIM_HDRS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -Inative/tests -o $@ $< $(ARB_TEST_SRCS) $(LDLIBS_ALL)

$(BUILD)/tests/t_%: native/tests/t_%.c $(CTEST_HDRS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -Inative/tests -o $@ $< $(LDLIBS_ALL)

# Sanitizer builds: same sources, separate trees.
asan:
	$(MAKE) all BUILD=build-asan OPT="-O1 -g -fno-omit-frame-pointer" \
	  EXTRA_CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined" \
	  EXTRA_LDFLAGS="-fsanitize=address,undefined"
tsan:
	$(MAKE) $(patsubst $(BUILD)/%,build-tsan/%,$(filter $(BUILD)/tests/t_region_%,$(CTESTS)) \
	  $(LIB) $(SIMCUDA) $(SIMNVML) $(BUILD)/tests/t_link_free_async \
	  $(BUILD)/tests/t_link_pool_sync_race $(BUILD)/tests/t_link_sm_threads) BUILD=build-tsan OPT="-O1 -g" \
	  EXTRA_CFLAGS="-fsanitize=thread" EXTRA_LDFLAGS="-fsanitize=thread"

# --- Kubernetes for the cluster tests -----------------------------------
# etcd, kube-apiserver and kube-scheduler, built from their published Go
# modules at the versions tests/k8s/go.mod pins (docs/kubernetes.md, "How the
# cluster half is tested"): one multi-call binary, a link per component.
# Built once; rebuilt only when tests/k8s/ changes.  Go is needed for this
# alone (>= the go line of tests/k8s/go.mod).
GO      ?= $(shell command -v go 2>/dev/null || echo /usr/local/go/bin/go)
K8S_DIR := $(BUILD)/k8s
K8S_BIN := $(K8S_DIR)/k8s-testenv
K8S_COMPONENTS := $(addprefix $(K8S_DIR)/,etcd kube-apiserver kube-scheduler)
# The version the components report (/version), as Kubernetes' own build
# stamps it, read from the one place it is pinned.
K8S_VERSION = $(shell sed -n 's/^[[:space:]]*k8s\.io\/kubernetes \(v[0-9.]*\)$$/\1/p' tests/k8s/go.mod)
K8S_STAMP = $(foreach kv,gitVersion=$(K8S_VERSION) gitMajor=$(patsubst v%,%,$(word 1,$(subst ., ,$(K8S_VERSION)))) \
  gitMinor=$(word 2,$(subst ., ,$(K8S_VERSION))) gitTreeState=clean,-X k8s.io/component-base/version.$(kv))

k8s: $(K8S_COMPONENTS)

$(K8S_BIN): tests/k8s/main.go tests/k8s/go.mod tests/k8s/go.sum
	@mkdir -p $(@D)
	@command -v $(GO) >/dev/null || { echo "make k8s: Go not found: $(GO) (install Go, or make k8s GO=/path/to/go)" >&2; exit 1; }
	cd tests/k8s && nice -n 10 $(GO) build -mod=readonly -trimpath -buildvcs=false \
	  -ldflags='-s -w $(K8S_STAMP)' -o $(CURDIR)/$@.tmp .
	mv $@.tmp $@

$(K8S_COMPONENTS): $(K8S_BIN)
	ln -sf $(notdir $(K8S_BIN)) $@

# --- Python side -------------------------------------------------------
$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@
venv: $(VENV)/.installed

test: all asan tsan lint k8s
	$(VENV)/bin/python -m pytest -n auto -q tests

test-fast: all venv
	$(VENV)/bin/python -m pytest -n auto -q -m "not slow" tests

# The trust-boundary fuzz (issue 36; docs/security.md): the tests/test_fuzz_*
# modules, which `make test` runs too (seed 36, about 30 s), here with
# FUZZ_SEED (default: a new one each run; a failure names it) for
# FUZZ_SECONDS of throwing at the node socket and HTTP port.
FUZZ_SEED ?= $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
FUZZ_SECONDS ?= 60
fuzz: all venv
	GPUVISOR_FUZZ_SEED=$(FUZZ_SEED) GPUVISOR_FUZZ_SECONDS=$(FUZZ_SECONDS) \
		$(VENV)/bin/python -m pytest -q -s tests/test_fuzz_agent.py tests/test_fuzz_region.py
.PHONY: fuzz

# Per-call cost of the memory hooks and of launches, in wall time and
# callgrind instructions (native/tests/bench_memory.c, bench_launch.c, the
# harness in bench_common.h); writes their sections of docs/benchmarks.md.
# LIBRARY=path/to/lib.so measures another interposer beside ours, with
# LIBRARY_ENV="NAME=VALUE ..." set for it (and LIBRARY_NAME for the tables);
# BENCH_ARGS go to both programs (docs/benchmarks.md).
BENCH_MEMORY := $(BUILD)/bench/bench_memory
BENCH_LAUNCH := $(BUILD)/bench/bench_launch
BENCH_HDRS := native/tests/bench_common.h native/tests/cuda_protos.h native/include/gv_cuda.h
BENCH_LINK = -L$(BUILD)/sim -Wl,-rpath,'$$ORIGIN/../sim' -lcuda $(LDLIBS_ALL)
$(BUILD)/bench/bench_%: native/tests/bench_%.c $(BENCH_HDRS) $(SIMCUDA)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -Inative/tests -o $@ $< $(BENCH_LINK)

LIBRARY ?=
LIBRARY_ENV ?=
LIBRARY_NAME ?=
BENCH_ARGS ?=
BENCH_PEER = $(if $(LIBRARY),--library '$(LIBRARY)' --library-env '$(LIBRARY_ENV)' \
	--library-name '$(LIBRARY_NAME)')

bench: all $(BENCH_MEMORY) $(BENCH_LAUNCH)
	$(BENCH_MEMORY) $(BENCH_PEER) $(BENCH_ARGS) --write docs/benchmarks.md
	$(BENCH_LAUNCH) $(BENCH_PEER) $(BENCH_ARGS) --write docs/benchmarks.md

# SM-quota benchmark (make bench-sm): accuracy of the quota on the simulated
# kernel timeline (tests/bench/sm_bench.py driving build/bench/bench_sm_worker,
# a -lcuda program) and per-launch cost (native/tests/bench_launch.c); writes
# its sections of docs/benchmarks.md.  Containers sharing a device
# (tests/bench/sm_shared.py) one experiment at a time, in seconds:
#   .venv/bin/python -m tests.bench.sm_shared --only 50:50 --mode time-sliced
#   --seconds 3 [--library other/libgpuvisor.so]
# and a change against the build before it, side by side in one sitting:
#   .venv/bin/python -m tests.bench.sm_shared --before base/libgpuvisor.so
.PHONY: bench-sm
BENCH_SM_WORKER := $(BUILD)/bench/bench_sm_worker
BENCH_STALL_PROBE := $(BUILD)/bench/bench_stall_probe
$(BENCH_SM_WORKER): native/tests/bench_sm_worker.c native/tests/cuda_protos.h native/include/gv_cuda.h $(SIMCUDA) $(SIMNVML)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -o $@ $< -L$(BUILD)/sim -lcuda -lm $(LDLIBS_ALL)

$(BENCH_STALL_PROBE): native/tests/bench_stall_probe.c
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -o $@ $< $(LDLIBS_ALL)

bench-sm: all venv $(BENCH_SM_WORKER) $(BENCH_LAUNCH) $(BENCH_STALL_PROBE)
	$(VENV)/bin/python -m tests.bench.sm_bench --write docs/benchmarks.md \
	  $(if $(LIBRARY),--launch-args "$(BENCH_PEER)")
	$(VENV)/bin/python -m tests.bench.sm_shared --write docs/benchmarks.md

# SM quota (tests/bench/torch_sm.py), memory oversubscription
# (tests/bench/torch_oversub.py) and how the GPU time-slices between contexts
# (tests/bench/torch_slice.py; its probe needs CuPy) on a real GPU with PyTorch: needs an
# NVIDIA GPU, and PyTorch and nvidia-ml-py in GPU_PYTHON; writes its tables to
# build/bench-gpu/ (figures from an H200 are in docs/benchmarks.md).
GPU_PYTHON ?= python3
.PHONY: bench-gpu
bench-gpu: lib
	$(GPU_PYTHON) -m tests.bench.torch_sm --lib $(LIB) --out $(BUILD)/bench-gpu
	$(GPU_PYTHON) -m tests.bench.torch_oversub --lib $(LIB) --out $(BUILD)/bench-gpu
	$(GPU_PYTHON) -m tests.bench.torch_slice --out $(BUILD)/bench-gpu

# Every real-GPU check in one command, for a machine lent for minutes: the
# `gpu` tests, then bench-gpu.  GPU_PYTHON needs PyTorch, nvidia-ml-py and
# pytest, not this package: the tree is put on its path (build/gpu-path).
GPU_PATH = PYTHONPATH=$(CURDIR)/$(BUILD)/gpu-path:$(CURDIR)
.PHONY: gpu-check
gpu-check: lib sim
	@mkdir -p $(BUILD)/gpu-path/gpuvisor
	@ln -sfn $(CURDIR)/shim $(BUILD)/gpu-path/gpuvisor/shim
	@ln -sfn $(CURDIR)/supervisor $(BUILD)/gpu-path/gpuvisor/supervisor
	@ln -sfn $(CURDIR)/cluster $(BUILD)/gpu-path/gpuvisor/cluster
	-$(GPU_PATH) $(GPU_PYTHON) -m pytest -m gpu -s -o addopts=-ra -p no:cacheprovider \
		tests/test_gpu_torch.py tests/test_visible_devices.py tests/test_deviceplugin_gpu.py
	$(GPU_PATH) $(GPU_PYTHON) -m tests.bench.torch_sm --lib $(LIB) --out $(BUILD)/bench-gpu
	$(GPU_PATH) $(GPU_PYTHON) -m tests.bench.torch_oversub --lib $(LIB) --out $(BUILD)/bench-gpu
	$(GPU_PATH) $(GPU_PYTHON) -m tests.bench.torch_slice --out $(BUILD)/bench-gpu

# The demo's own environment: the runtime dependencies and matplotlib (the
# plot extra), not the test set.
DEMO_VENV ?= build/demo-venv
$(DEMO_VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/pip install -q --upgrade pip
	$(DEMO_VENV)/bin/pip install -q -e '.[plot]'
	touch $@

demo: all $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/python -m gpuvisor.supervisor demo --out build/demo

lint: venv
	$(VENV)/bin/ruff check shim tests setup.py $(wildcard supervisor cluster)
	$(VENV)/bin/ruff format --check shim tests setup.py $(wildcard supervisor cluster)
	$(VENV)/bin/mypy

# The device plugin's gRPC modules, generated from its .proto files and
# committed (tests/test_deviceplugin_proto.py checks they are up to date).
protos: venv
	$(VENV)/bin/python -m gpuvisor.cluster.deviceplugin.api.generate

clean:
	rm -rf build build-asan build-tsan

# Node-agent benchmark (make bench-agent): 1,000 simulated containers
# reporting to one agent pinned to one CPU (tests/bench/agent_bench.py);
# writes its section of docs/benchmarks.md.
.PHONY: bench-agent
bench-agent: venv
	$(VENV)/bin/python -m tests.bench.agent_bench --write docs/benchmarks.md

# Allocator benchmark (make bench-place): decision speed on 1,000 nodes x 8
# GPUs and placement quality against HAMi's rules and the exact optimum
# (tests/bench/place_bench.py); writes its section of docs/benchmarks.md.
.PHONY: bench-place
bench-place: venv
	$(VENV)/bin/python -m tests.bench.place_bench --write docs/benchmarks.md

# The cluster half at work (make demo-cluster): a real etcd, kube-apiserver
# and kube-scheduler (make k8s), gpuvisor's extender, two simulated GPU nodes
# each behind a real `gpuvisor device-plugin`; the demo's pods are placed,
# admitted and run under the library, then summarised (tests/demo_cluster.py,
# docs/kubernetes.md).  `make demo` needs no Kubernetes build.
.PHONY: demo-cluster
demo-cluster: all venv k8s
	$(VENV)/bin/python -m tests.demo_cluster

# Scheduling throughput (make bench-cluster): pods/s through the real
# kube-scheduler with 1,000 Nodes of 8 GPUs, without and with the extender
# (tests/bench/cluster_bench.py), 3 rounds, judged on the median ratio;
# writes its section of docs/benchmarks.md.
.PHONY: bench-cluster
bench-cluster: venv k8s
	$(VENV)/bin/python -m tests.bench.cluster_bench --rounds 3 --write docs/benchmarks.md
