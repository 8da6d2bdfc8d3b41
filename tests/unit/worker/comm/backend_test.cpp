// fsdp::init()'s choice of communicator (chooseBackend), every bad case one clear error, and
// the build's promise that the NCCL communicator is in where /usr/local/cuda has NCCL.
#include <gtest/gtest.h>

#include <ATen/Context.h>

#include <filesystem>

#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "fsdp/worker/nccl_communicator.hpp"
#include "fsdp/worker/runtime.hpp"

namespace {

using fsdp::ConfigError;
using fsdp::worker::Backend;
using fsdp::worker::BackendProbe;
using fsdp::worker::chooseBackend;
using fsdp::worker::parseBackend;

const BackendProbe kGpuBox{.ncclBuilt = true, .torchCuda = true, .devices = 4, .visibleDevices = "'0,1,2,3'"};
const BackendProbe kCpuBox{.ncclBuilt = true, .torchCuda = false, .devices = 0};

// The ConfigError's text, or "" when none was thrown.
template <typename F>
std::string configError(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(Backend, ParsesTheThreeNamesInAnyCase) {
  EXPECT_EQ(parseBackend("gloo", "X"), Backend::kGloo);
  EXPECT_EQ(parseBackend("NCCL", "X"), Backend::kNccl);
  EXPECT_EQ(parseBackend("Auto", "X"), Backend::kAuto);
  EXPECT_EQ(parseBackend("shm", "X"), Backend::kShm);
  const auto message = configError([] { parseBackend("mpi", "FSDPRUN_BACKEND"); });
  EXPECT_EQ(message, "FSDPRUN_BACKEND='mpi': expected gloo, shm, nccl or auto");
}

TEST(Backend, AutoPicksNcclOnlyWhereBuildLibTorchAndDeviceAllAllowIt) {
  EXPECT_EQ(chooseBackend(std::nullopt, Backend::kAuto, kGpuBox, 0, 4).backend, Backend::kNccl);
  const auto cpu = chooseBackend(std::nullopt, Backend::kAuto, kCpuBox, 0, 4);
  EXPECT_EQ(cpu.backend, Backend::kShm);
  EXPECT_NE(cpu.reason.find("LibTorch has no CUDA"), std::string::npos) << cpu.reason;
  auto noNccl = kGpuBox;
  noNccl.ncclBuilt = false;
  EXPECT_EQ(chooseBackend(std::nullopt, Backend::kAuto, noNccl, 0, 4).backend, Backend::kShm);
  EXPECT_EQ(chooseBackend(std::nullopt, Backend::kAuto, noNccl, 0, 1).backend, Backend::kGloo)
      << "one rank on the node: nothing to share";
  auto noDevice = kGpuBox;
  noDevice.devices = 0;
  const auto none = chooseBackend(std::nullopt, Backend::kAuto, noDevice, 0, 4);
  EXPECT_EQ(none.backend, Backend::kShm);
  EXPECT_NE(none.reason.find("no CUDA device"), std::string::npos) << none.reason;
}

TEST(Backend, TheDeviceIsTheLocalRankModuloTheVisibleDevices) {
  for (int localRank = 0; localRank < 9; ++localRank) {
    const auto choice = chooseBackend(std::nullopt, Backend::kNccl, kGpuBox, localRank, 4);
    EXPECT_EQ(choice.backend, Backend::kNccl);
    EXPECT_EQ(choice.device, localRank % 4);
  }
  EXPECT_EQ(chooseBackend(std::nullopt, Backend::kAuto, kGpuBox, 0, 4).device, 0);
  EXPECT_EQ(chooseBackend(std::nullopt, Backend::kGloo, kGpuBox, 3, 4).device, -1);
}

TEST(Backend, MoreRanksOnTheNodeThanDevicesIsRefusedWithTheWayOut) {
  const auto message = configError([] { chooseBackend(std::nullopt, Backend::kAuto, kGpuBox, 5, 8); });
  EXPECT_EQ(message, "auto: 8 ranks on this node (LOCAL_WORLD_SIZE) but 4 CUDA device(s) visible; NCCL "
                     "needs one device per rank: start one worker per GPU (fsdprun --nproc_per_node gpu) "
                     "or set FSDPRUN_BACKEND=gloo");
  EXPECT_EQ(chooseBackend("gloo", Backend::kAuto, kGpuBox, 5, 8).backend, Backend::kGloo);
}

TEST(Backend, TheEnvironmentOverridesTheProgram) {
  EXPECT_EQ(chooseBackend("gloo", Backend::kNccl, kGpuBox, 0, 4).backend, Backend::kGloo);
  EXPECT_EQ(chooseBackend("gloo", Backend::kAuto, kCpuBox, 0, 4).backend, Backend::kGloo) << "gloo forces plain Gloo";
  EXPECT_EQ(chooseBackend("shm", Backend::kGloo, kCpuBox, 0, 4).backend, Backend::kShm);
  EXPECT_EQ(chooseBackend("nccl", Backend::kGloo, kGpuBox, 1, 4).backend, Backend::kNccl);
  EXPECT_EQ(chooseBackend("auto", Backend::kGloo, kGpuBox, 1, 4).backend, Backend::kNccl);
  // Set but empty counts as unset (a cleared variable in a Slurm script).
  EXPECT_EQ(chooseBackend("", Backend::kGloo, kGpuBox, 1, 4).backend, Backend::kGloo);
  EXPECT_EQ(configError([] { chooseBackend("infiniband", Backend::kAuto, kGpuBox, 0, 4); }),
            "FSDPRUN_BACKEND='infiniband': expected gloo, shm, nccl or auto");
}

// A libfsdp without Gloo (LibTorch has its own copy): asking for Gloo names the reason; auto
// never picks it, and one CPU rank gets shared memory instead.
TEST(Backend, WithoutGlooInTheBuildGlooIsRefusedAndAutoTakesSharedMemory) {
  auto noGloo = kCpuBox;
  noGloo.noGloo = "LibTorch has its own Gloo";
  EXPECT_EQ(configError([&] { chooseBackend("gloo", Backend::kAuto, noGloo, 0, 1); }),
            "FSDPRUN_BACKEND=gloo: this libfsdp has no Gloo: LibTorch has its own Gloo; expected shm, nccl or auto");
  EXPECT_EQ(chooseBackend(std::nullopt, Backend::kAuto, noGloo, 0, 1).backend, Backend::kShm);
  EXPECT_EQ(chooseBackend(std::nullopt, Backend::kAuto, kCpuBox, 0, 1).backend, Backend::kGloo);
  EXPECT_EQ(chooseBackend(std::nullopt, Backend::kAuto, noGloo, 0, 4).backend, Backend::kShm);
}

TEST(Backend, NcclAskedForWithoutNcclInTheBuildNamesTheRequestAndTheWayOut) {
  auto noNccl = kGpuBox;
  noNccl.ncclBuilt = false;
  const auto fromEnv = configError([&] { chooseBackend("nccl", Backend::kAuto, noNccl, 0, 4); });
  EXPECT_EQ(fromEnv.rfind("FSDPRUN_BACKEND=nccl: this libfsdp was built without NCCL", 0), 0u) << fromEnv;
  EXPECT_NE(fromEnv.find("FSDPRUN_BACKEND=gloo"), std::string::npos) << fromEnv;
  const auto fromProgram = configError([&] { chooseBackend(std::nullopt, Backend::kNccl, noNccl, 0, 4); });
  EXPECT_EQ(fromProgram.rfind("InitOptions::backend = nccl: this libfsdp was built without NCCL", 0), 0u)
      << fromProgram;
}

TEST(Backend, NcclAskedForWithACpuLibTorchOrNoDeviceIsRefusedNamingWhy) {
  const auto cpuTorch = configError([] { chooseBackend("nccl", Backend::kAuto, kCpuBox, 0, 4); });
  EXPECT_NE(cpuTorch.find("this LibTorch has no CUDA"), std::string::npos) << cpuTorch;
  auto noDevice = kGpuBox;
  noDevice.devices = 0;
  noDevice.visibleDevices = "''";
  const auto none = configError([&] { chooseBackend("nccl", Backend::kAuto, noDevice, 0, 4); });
  EXPECT_EQ(none, "FSDPRUN_BACKEND=nccl: no CUDA device is visible to this process "
                  "(CUDA_VISIBLE_DEVICES=''); set FSDPRUN_BACKEND=gloo to train on CPU");
}

TEST(Backend, ThisProcessIsProbedAsItIs) {
  const auto probe = fsdp::worker::probeBackends();
  EXPECT_EQ(probe.ncclBuilt, fsdp::worker::ncclAvailable());
  EXPECT_EQ(probe.torchCuda, at::hasCUDA());
  if (!probe.torchCuda) {
    EXPECT_EQ(probe.devices, 0);
  }
  // Whatever this machine is, auto never throws and gives a backend it can run.
  const auto choice = chooseBackend(std::nullopt, Backend::kAuto, probe, 0, 1);
  EXPECT_EQ(choice.backend == Backend::kNccl, probe.ncclBuilt && probe.torchCuda && probe.devices > 0);
}

// CMake's FSDP_REQUIRE_NCCL makes configuration fail where NCCL is at hand but not found; this
// checks the library that was linked, so that turning that option off cannot go unnoticed.
TEST(NcclBuild, TheCommunicatorIsBuiltWhereUsrLocalCudaHasNccl) {
#if FSDP_SANITIZE_BUILD
  GTEST_SKIP() << "sanitizer builds leave NCCL out on purpose";
#else
  if (!std::filesystem::exists("/usr/local/cuda/include/nccl.h")) {
    GTEST_SKIP() << "no /usr/local/cuda/include/nccl.h on this machine";
  }
  EXPECT_TRUE(fsdp::worker::ncclAvailable())
      << "/usr/local/cuda has NCCL but this libfsdp was built without the NCCL communicator";
#endif
}

TEST(NcclBuild, CreatingOneWithoutADeviceIsOneClearError) {
  // No GPU (or no NCCL in the build): a ConfigError naming the device count, never a crash.
  if (fsdp::worker::cudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is visible (tests labelled gpu cover it)";
  using namespace std::chrono_literals;
  fsdp::rendezvous::StoreServer server(fsdp::rendezvous::ServerOptions{});
  auto store = fsdp::rendezvous::StoreClient::connect("127.0.0.1", server.port(), {.timeout = 10s});
  const auto message = configError([&] {
    fsdp::worker::createNcclCommunicator(*store, {.rank = 0, .size = 1, .device = 0, .timeout = 10s});
  });
  EXPECT_FALSE(store->check({"nccl/unique_id"})) << "refused before anything was published";
  EXPECT_FALSE(message.empty());
  if (fsdp::worker::ncclAvailable()) {
    EXPECT_NE(message.find("0 CUDA device(s) visible"), std::string::npos) << message;
  } else {
    EXPECT_NE(message.find("built without NCCL"), std::string::npos) << message;
  }
}

}  // namespace
