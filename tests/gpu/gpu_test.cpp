// Tests labelled `gpu`: the NCCL path on real devices. Ranks are threads of this process, one
// CUDA device each (as many ranks as visible devices, at most 4: NCCL refuses two ranks on one
// device, so one GPU means world size 1), with a real store on loopback, a CPU communicator
// (Gloo, or shared memory in a build against a LibTorch with its own Gloo) and an NCCL
// communicator per rank. Each test skips, naming
// why, where this build or machine cannot run it (no NCCL in the build, a CPU LibTorch, no
// device). scripts/gpu-check runs them on a machine with a GPU.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/core/DeviceGuard.h>
#include <torch/nn.h>
#include <torch/optim.h>

#include <cmath>
#include <future>
#include <iostream>
#include <sstream>

#include "comm/nccl/nccl_bootstrap.hpp"
#include "comm/nccl/staged_communicator.hpp"
#include "communicator_checks.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "fsdp/worker/fsdp.hpp"
#include "fsdp/worker/gloo_communicator.hpp"
#include "fsdp/worker/nccl_communicator.hpp"
#include "fsdp/worker/shm_communicator.hpp"

namespace {

using namespace std::chrono_literals;
namespace fw = fsdp::worker;

// Why this machine cannot run the GPU tests ("" when it can).
std::string whyNoGpu() {
  if (!fw::ncclAvailable()) return "this libfsdp was built without NCCL";
  if (!at::hasCUDA()) return "this LibTorch has no CUDA (configure with a CUDA LibTorch: scripts/gpu-check)";
  if (fw::cudaDeviceCount() < 1) return "no CUDA device is visible";
  return "";
}

#define SKIP_WITHOUT_GPU()                                    \
  do {                                                        \
    if (const auto why = whyNoGpu(); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

struct GpuRank {
  int rank;
  int world;
  at::Device device;
  fw::Communicator& gloo;  // the CPU reference (Gloo or shared memory)
  fw::Communicator& nccl;
  fw::Communicator& replicate;
};

// Runs `body` on one thread per device (at most 4), each with its Gloo and NCCL communicator.
void runGpuRanks(const std::function<void(GpuRank&)>& body) {
  const int world = std::min(fw::cudaDeviceCount(), 4);
  fsdp::rendezvous::StoreServer server(fsdp::rendezvous::ServerOptions{});
  std::vector<std::future<void>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::async(std::launch::async, [&, r] {
      const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(r));
      const c10::DeviceGuard guard(device);
      auto store = fsdp::rendezvous::StoreClient::connect("127.0.0.1", server.port(), {.timeout = 60s});
      auto gloo = fw::glooAvailable()
                      ? fw::createGlooCommunicator(*store, {.rank = r, .size = world, .storePrefix = "gloo", .timeout = 60s})
                      : fw::createShmCommunicator(*store, {.rank = r, .size = world, .storePrefix = "shm",
                                                           .runId = "gpu-test", .timeout = 60s});
      auto nccl = fw::createNcclCommunicator(
          *store, {.rank = r, .size = world, .device = r, .storePrefix = "nccl", .timeout = 60s});
      // HYBRID_SHARD's replicate group: a second NCCL communicator over the same ranks.
      auto replicate = fw::createNcclCommunicator(
          *store, {.rank = r, .size = world, .device = r, .storePrefix = "nccl-replicate", .timeout = 60s});
      GpuRank ctx{r, world, device, *gloo, *nccl, *replicate};
      body(ctx);
      replicate->barrier().wait();
      nccl->barrier().wait();
      gloo->barrier().wait();
    }));
  }
  for (auto& f : ranks) f.wait();
  for (auto& f : ranks) f.get();
}

// Where NCCL's result and the CPU reference part: how many elements, the largest gap, the first
// differing index, and at world 1 (where every reduction is the input itself) which side is off.
std::string differences(const at::Tensor& gpu, const at::Tensor& cpu, const at::Tensor& input, int world) {
  std::ostringstream out;
  const auto gap = (gpu - cpu).abs();
  const auto bad = gap.gt(1e-6 + 1e-5 * cpu.abs());
  out << bad.sum().item<std::int64_t>() << " of " << gpu.numel() << " differ, max |gap| "
      << gap.max().item<double>();
  if (bad.any().item<bool>()) out << ", first at " << bad.nonzero()[0][0].item<std::int64_t>();
  if (world == 1) {
    const auto in = input.slice(0, 0, gpu.numel());
    out << "; vs the input: NCCL max |gap| " << (gpu - in).abs().max().item<double>() << ", CPU "
        << (cpu - in).abs().max().item<double>();
  }
  return out.str();
}

// The same collective through NCCL on the device and through Gloo on the CPU, compared.
TEST(GpuNccl, EveryCollectiveMatchesGloo) {
  SKIP_WITHOUT_GPU();
  runGpuRanks([](GpuRank& g) {
    for (const auto dtype : {at::kFloat, at::kDouble}) {
      for (const std::int64_t chunk : {1L, 1000L, (1L << 18) + 3}) {
        const auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(1000 * g.rank + chunk));
        const auto mine = at::randn({chunk * g.world}, gen, at::TensorOptions().dtype(dtype));
        const auto onDevice = [&](const at::Tensor& t) { return t.to(g.device); };
        for (const auto op : {fw::ReduceOp::kSum, fw::ReduceOp::kAverage, fw::ReduceOp::kMax}) {
          auto cpu = mine.clone();
          auto gpu = onDevice(mine);
          g.gloo.allReduce(cpu, op).wait();
          g.nccl.allReduce(gpu, op).wait();
          EXPECT_TRUE(at::allclose(gpu.cpu(), cpu, 1e-5, 1e-6))
              << "allReduce chunk " << chunk << " " << dtype << " op " << static_cast<int>(op)
              << " world " << g.world << ": " << differences(gpu.cpu(), cpu, mine, g.world);
          // Outputs start as NaN: an element NCCL never wrote fails every time, not only where
          // the allocator handed back memory that did not happen to hold the answer.
          auto cpuOut = at::full({chunk}, NAN, mine.options());
          auto gpuOut = at::full({chunk}, NAN, mine.options().device(g.device));
          g.gloo.reduceScatter(mine, cpuOut, op).wait();
          g.nccl.reduceScatter(onDevice(mine), gpuOut, op).wait();
          EXPECT_TRUE(at::allclose(gpuOut.cpu(), cpuOut, 1e-5, 1e-6))
              << "reduceScatter chunk " << chunk << " " << dtype << " op " << static_cast<int>(op)
              << " world " << g.world << ": " << differences(gpuOut.cpu(), cpuOut, mine, g.world);
        }
        const auto part = mine.slice(0, 0, chunk).contiguous();
        auto cpuAll = at::full({chunk * g.world}, NAN, mine.options());
        auto gpuAll = at::full({chunk * g.world}, NAN, mine.options().device(g.device));
        g.gloo.allGather(part, cpuAll).wait();
        g.nccl.allGather(onDevice(part), gpuAll).wait();
        EXPECT_TRUE(at::equal(gpuAll.cpu(), cpuAll)) << "allGather chunk " << chunk;
        auto cpuB = mine.clone();
        auto gpuB = onDevice(mine);
        g.gloo.broadcast(cpuB, g.world - 1).wait();
        g.nccl.broadcast(gpuB, g.world - 1).wait();
        EXPECT_TRUE(at::equal(gpuB.cpu(), cpuB)) << "broadcast chunk " << chunk;
      }
    }
  });
}

TEST(GpuNccl, BadInputsAreNamedBeforeAnythingRuns) {
  SKIP_WITHOUT_GPU();
  runGpuRanks([](GpuRank& g) {
    auto cpu = at::ones({4});
    EXPECT_THROW(g.nccl.allReduce(cpu).wait(), fsdp::Error);
    auto ints = at::ones({4}, at::TensorOptions().dtype(at::kBool).device(g.device));
    EXPECT_THROW(g.nccl.allReduce(ints).wait(), fsdp::Error);
    auto out = at::empty({3 * g.world + 1}, at::TensorOptions().device(g.device));
    EXPECT_THROW(g.nccl.allGather(at::ones({3}, out.options()), out).wait(), fsdp::Error);
  });
}

// An all-reduce of 64 M floats issued on `nccl`, then the communicator aborted at once (the
// operation in flight, or just finished): "" when its wait returned or threw CommAborted and a
// later operation was refused with CommAborted; what went wrong otherwise.
std::string abortWithAnOperationInFlight(fw::Communicator& nccl, const at::Device& device, const std::string& why) {
  auto big = at::ones({64L << 20}, at::TensorOptions().device(device));
  auto work = nccl.allReduce(big);
  if (!nccl.abort(why)) return "abort() said the device needs a new process";
  try {
    work.wait();
  } catch (const fsdp::CommAborted&) {
  } catch (const std::exception& e) {
    return std::string("the operation in flight: another error than CommAborted: ") + e.what();
  }
  try {
    nccl.allReduce(big).wait();
    return "an operation after the abort was not refused";
  } catch (const fsdp::CommAborted&) {
  }
  return "";
}

// The next round's communicator of `world` ranks sums right and passes a barrier: "" when so.
std::string stepsAgain(fw::Communicator& next, int rank, int world, const at::Device& device) {
  auto t = at::full({1000}, static_cast<float>(rank + 1), at::TensorOptions().device(device));
  next.allReduce(t).wait();
  const float expected = static_cast<float>(world * (world + 1) / 2);
  if (!at::equal(t.cpu(), at::full({1000}, expected))) return "the next communicator's sum is wrong";
  next.barrier().wait();
  return "";
}

// Communicator::abort on a real device (an in-process re-formation, reform.hpp): an all-reduce
// of 64 M floats issued, the communicator aborted at once (the operation in flight, or just
// finished: its wait returns or throws CommAborted, never hangs); every later operation is
// refused with CommAborted; a new communicator (the next round's id) steps again and sums right.
TEST(GpuNccl, AnAbortWithAnOperationInFlightThenTheNextCommunicatorStepsAgain) {
  SKIP_WITHOUT_GPU();
  const int world = std::min(fw::cudaDeviceCount(), 4);
  fsdp::rendezvous::StoreServer server(fsdp::rendezvous::ServerOptions{});
  std::vector<std::future<std::string>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::async(std::launch::async, [&, r]() -> std::string {
      const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(r));
      const c10::DeviceGuard guard(device);
      auto store = fsdp::rendezvous::StoreClient::connect("127.0.0.1", server.port(), {.timeout = 60s});
      auto nccl = fw::createNcclCommunicator(
          *store, {.rank = r, .size = world, .device = r, .storePrefix = "abort/round1", .timeout = 60s});
      if (auto wrong = abortWithAnOperationInFlight(*nccl, device, "test: the round ended"); !wrong.empty()) {
        return wrong;
      }
      nccl.reset();
      auto next = fw::createNcclCommunicator(
          *store, {.rank = r, .size = world, .device = r, .storePrefix = "abort/round2", .timeout = 60s});
      return stepsAgain(*next, r, world, device);
    }));
  }
  for (auto& f : ranks) EXPECT_EQ(f.get(), "");
}

// The abort of a re-formation on a library with ncclCommRevoke and ncclCommShrink (NCCL 2.28+;
// on an older one the abort path again): an all-reduce of 64 M floats in flight, the
// communicator aborted (revoked), its waiter woken, the revoked communicator taken as the next
// round's parent. With two devices or more the last rank is lost and the others shrink the
// parent (no new id) and sum right; with one, nothing was lost: the parent goes and a new id
// serves, as it does wherever a rank is new.
TEST(GpuNccl, ARevokedCommunicatorIsShrunkToTheSurvivorsOrGivesWayToANewId) {
  SKIP_WITHOUT_GPU();
  namespace fd = fw::detail;
  const int world = std::min(fw::cudaDeviceCount(), 4);
  const auto api = fd::cudaNcclApi();
  const bool shrinks = api->canShrink();
  std::cout << "NCCL " << fd::ncclLibraryVersion() << ": ncclCommRevoke and ncclCommShrink " << (shrinks ? "found" : "absent")
            << "\n";
  const int survivors = world > 1 ? world - 1 : 1;
  fsdp::rendezvous::StoreServer server(fsdp::rendezvous::ServerOptions{});
  std::vector<std::future<std::string>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::async(std::launch::async, [&, r]() -> std::string {
      const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(r));
      const c10::DeviceGuard guard(device);
      auto store = fsdp::rendezvous::StoreClient::connect("127.0.0.1", server.port(), {.timeout = 60s});
      auto nccl = fd::createNcclCommunicator(
          *store, {.rank = r, .size = world, .device = r, .storePrefix = "shrink/round1", .timeout = 60s}, api,
          fsdp::Deadline::after(60s));
      const auto why = "test: rank " + std::to_string(world - 1) + " was lost";
      if (auto wrong = abortWithAnOperationInFlight(*nccl, device, why); !wrong.empty()) return wrong;
      auto parent = fd::takeNcclParent(*nccl);
      if (shrinks != (parent != nullptr)) {
        return shrinks ? "the abort kept no revoked communicator" : "a parent without revoke in the library";
      }
      nccl.reset();
      if (r >= survivors) return "";  // the lost rank: its parent aborted with it
      auto next = fd::createNcclCommunicator(
          *store, {.rank = r, .size = survivors, .device = r, .storePrefix = "shrink/round2", .timeout = 60s}, api,
          fsdp::Deadline::after(60s), std::move(parent), true);
      return stepsAgain(*next, r, survivors, device);
    }));
  }
  for (auto& f : ranks) EXPECT_EQ(f.get(), "");
}

// The CPU world of a job over several nodes without Gloo (fsdp::init() under NCCL where LibTorch
// has its own Gloo): CPU tensors staged through a second NCCL communicator. Every operation,
// dtype and uneven size equals the local result.
TEST(GpuNccl, CpuTensorsStagedThroughNcclEqualTheLocalResult) {
  SKIP_WITHOUT_GPU();
  const int world = std::min(fw::cudaDeviceCount(), 4);
  fsdp::rendezvous::StoreServer server(fsdp::rendezvous::ServerOptions{});
  std::vector<std::future<void>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::async(std::launch::async, [&, r] {
      const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(r));
      const c10::DeviceGuard guard(device);
      auto store = fsdp::rendezvous::StoreClient::connect("127.0.0.1", server.port(), {.timeout = 60s});
      auto cpu = fw::detail::makeStagedCommunicator(fw::createNcclCommunicator(
          *store, {.rank = r, .size = world, .device = r, .storePrefix = "nccl/cpu", .timeout = 60s}));
      EXPECT_EQ(cpu->deviceType(), c10::DeviceType::CPU);
      fsdp::testing::checkEveryOperation(*cpu, r, world, /*oneRounding=*/world == 1);
      cpu->barrier().wait();
    }));
  }
  for (auto& f : ranks) f.wait();
  for (auto& f : ranks) f.get();
}

// A small model trained for 3 steps with FSDP over NCCL must equal one process on the global
// batch (the same model on this device), parameter by parameter. With `exactAtOneRank`, a world
// of one rank must give the same bits: nothing is reduced across ranks, so FSDP may only move
// parameters, never change the arithmetic.
void trainAndCompare(const fw::FsdpOptions& base, double rtol, double atol, bool exactAtOneRank = false) {
  runGpuRanks([&](GpuRank& g) {
    const auto make = [&] {
      torch::manual_seed(7);
      torch::nn::Sequential net(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                                torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})), torch::nn::Linear(64, 10));
      net->to(g.device);
      return net;
    };
    auto options = base;
    options.autoWrap = fw::AutoWrapPolicy::minParams(1000);
    if (options.strategy == fw::ShardingStrategy::kHybridShard) {
      options.shardGroup = &g.nccl;
      options.replicateGroup = &g.replicate;
    }
    fw::FullyShardedDataParallel model(make(), g.nccl, options);
    auto reference = make();
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD refOpt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    const std::int64_t local = 6;
    for (int step = 0; step < 3; ++step) {
      const auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(100 + step));
      const auto x = at::randn({local * g.world, 32}, gen).to(g.device);
      const auto y = at::randint(10, {local * g.world}, gen, at::kLong).to(g.device);
      opt.zero_grad();
      const auto mine = x.slice(0, g.rank * local, (g.rank + 1) * local);
      torch::nn::functional::cross_entropy(model->forward(mine).to(at::kFloat),
                                           y.slice(0, g.rank * local, (g.rank + 1) * local))
          .backward();
      opt.step();
      refOpt.zero_grad();
      torch::nn::functional::cross_entropy(reference->forward(x), y).backward();
      refOpt.step();
    }
    const auto full = model->fullParameters();
    const auto expected = reference->named_parameters();
    ASSERT_EQ(full.size(), expected.size());
    for (const auto& [name, value] : full) {
      const auto want = expected[name].detach().cpu();
      if (exactAtOneRank && g.world == 1) {
        EXPECT_TRUE(at::equal(value.cpu().to(at::kFloat), want))
            << name << ": not bit-identical at one rank; max difference "
            << (value.cpu().to(at::kFloat) - want).abs().max().item<double>();
        continue;
      }
      EXPECT_TRUE(at::allclose(value.cpu().to(at::kFloat), want, rtol, atol))
          << name << " on rank " << g.rank << ": max difference "
          << (value.cpu().to(at::kFloat) - want).abs().max().item<double>();
    }
  });
}

TEST(GpuFsdp, FullShardOnCudaEqualsOneProcess) {
  SKIP_WITHOUT_GPU();
  // cuBLAS may use TF32 for fp32 matmuls where allowed; the reference runs on the same device.
  trainAndCompare({}, 1e-4, 1e-5, /*exactAtOneRank=*/true);
}

TEST(GpuFsdp, EveryStrategyOnCudaEqualsOneProcess) {
  SKIP_WITHOUT_GPU();
  for (const auto strategy : {fw::ShardingStrategy::kShardGradOp, fw::ShardingStrategy::kNoShard,
                              fw::ShardingStrategy::kHybridShard}) {
    SCOPED_TRACE(static_cast<int>(strategy));
    trainAndCompare({.strategy = strategy}, 1e-4, 1e-5, /*exactAtOneRank=*/true);
  }
}

TEST(GpuFsdp, Bf16MixedPrecisionStaysCloseToFp32) {
  SKIP_WITHOUT_GPU();
  trainAndCompare({.mixedPrecision = fw::MixedPrecision::parse("bf16")}, 5e-2, 2e-2);
}

TEST(GpuFsdp, CpuOffloadEqualsOneProcess) {
  SKIP_WITHOUT_GPU();
  trainAndCompare({.cpuOffload = true}, 1e-4, 1e-5);
}

}  // namespace
