# fsdprun — the commands a user and CI need.
#   make demo    install and build only what the demo needs, train mnist on 2 processes for one epoch
#   make test    install what is missing, build, run every test (SANITIZE=1: ASan+UBSan build)
#   make bench   install what is missing, build, run every benchmark (JSON lines)
#   make build   install what is missing, build
#   make fuzz-fsdp FUZZ_SECONDS=N   generated FSDP cases against one process for N seconds
#   make chaos CHAOS_SECONDS=N      an elastic job under random kills and freezes for N seconds
#   make checkpoint-kills CKPT_KILL_TRIALS=N   N SIGKILLs at random points of checkpoint saves
#   make gpu-bundle     fetch what a bare GPU machine lacks into .deps (scripts/gpu-bundle)
#   make test-stripped  the CPU test suite built from .deps alone, system copies hidden (root)
#   make gpu-check-build  scripts/gpu-check --build-only: the GPU check up to the GPU boundary
#   make torch2-check     every LibTorch-using file, syntax only, against Debian sid's LibTorch 2.x
SANITIZE ?= 0
ifeq ($(SANITIZE),1)
BUILD_DIR ?= build-asan
CMAKE_FLAGS += -DFSDP_SANITIZE=ON
else
BUILD_DIR ?= build
endif
CMAKE_BUILD_TYPE ?= RelWithDebInfo
JOBS ?= $(shell nproc)
# ccache must not tell precompiled headers apart by their timestamps.
export CCACHE_SLOPPINESS := pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_MAXSIZE ?= 5G

.PHONY: all deps configure build test demo bench fuzz fuzz-fsdp chaos checkpoint-kills clean format gpu-bundle test-stripped gpu-check-build torch2-check

all: build

deps:
	@scripts/install-deps --check || scripts/install-deps

$(BUILD_DIR)/build.ninja:
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(CMAKE_BUILD_TYPE) $(CMAKE_FLAGS)

configure: deps $(BUILD_DIR)/build.ninja

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure --timeout 600 -j $(JOBS) $(CTEST_ARGS)

# Installs and builds only what the demo runs (scripts/demo), then trains.
demo:
	@JOBS=$(JOBS) CMAKE_BUILD_TYPE=$(CMAKE_BUILD_TYPE) CMAKE_FLAGS="$(CMAKE_FLAGS)" scripts/demo $(BUILD_DIR)

bench: build
	$(BUILD_DIR)/bin/fsdp-bench --all

# libFuzzer on the frame decoders (clang), FUZZ_SECONDS long.
FUZZ_SECONDS ?= 60
fuzz: deps
	cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DFSDP_FUZZ=ON -DFSDP_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build build-fuzz --target frame_fuzzer
	mkdir -p build-fuzz/corpus
	build-fuzz/bin/frame_fuzzer -max_total_time=$(FUZZ_SECONDS) build-fuzz/corpus

# The FSDP differential test, drawing new cases from a random base for FUZZ_SECONDS; a failure
# prints the seed that replays it (FSDP_DIFF_SEED=<seed>).
fuzz-fsdp: build
	@FSDP_DIFF_SECONDS=$(FUZZ_SECONDS) $(BUILD_DIR)/bin/differential_fsdp \
	  --gtest_filter='FsdpDifferential.*' > $(BUILD_DIR)/fuzz-fsdp.log 2>&1; status=$$?; \
	  tail -n 30 $(BUILD_DIR)/fuzz-fsdp.log; echo "every case: $(BUILD_DIR)/fuzz-fsdp.log"; exit $$status

# The chaos test with a new random seed (printed; CHAOS_SEED=<seed> replays it).
CHAOS_SECONDS ?= 600
chaos: build
	CHAOS_SECONDS=$(CHAOS_SECONDS) $(BUILD_DIR)/bin/system_chaos

# The checkpoint kill test with a long series of kills from a random seed (CI runs 12 from a fixed one).
CKPT_KILL_TRIALS ?= 200
checkpoint-kills: build
	CKPT_KILL_TRIALS=$(CKPT_KILL_TRIALS) CKPT_KILL_SEED=$${CKPT_KILL_SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')} \
	  $(BUILD_DIR)/bin/integration_checkpoint --gtest_filter=CheckpointSave.SigkillAtRandomPointsOfSavesNeverLeavesAnUnloadableNewestCheckpoint

gpu-bundle:
	scripts/gpu-bundle

test-stripped: deps gpu-bundle
	scripts/gpu-bundle --stripped-test -j $(JOBS) $(CTEST_ARGS)

gpu-check-build: deps
	scripts/gpu-check --build-only

torch2-check: build
	scripts/torch2-check --build-dir $(BUILD_DIR) -j $(JOBS)

format:
	find common rendezvous launcher slurm worker examples tests bench -name '*.[ch]pp' | xargs clang-format -i

clean:
	rm -rf build build-asan build-fuzz build-gpu build-bundle
