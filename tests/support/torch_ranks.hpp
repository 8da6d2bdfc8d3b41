#pragma once
// Ranks as threads of one test process: each gets its own store client and a real
// communicator (and, when asked, a Runtime), over a real store server on loopback. For tests
// that link LibTorch (unit_fsdp, the FSDP differential harness). The communicator is the one
// fsdp::init() picks for CPU ranks of one node, shared memory; FSDP_TEST_COMM=gloo runs the
// same tests over Gloo.

#include <cstdlib>
#include <functional>
#include <future>
#include <memory>
#include <vector>

#include <ATen/Functions.h>
#include <torch/nn/module.h>

#include "fsdp/rendezvous/store_server.hpp"
#include "fsdp/worker/gloo_communicator.hpp"
#include "fsdp/worker/runtime.hpp"
#include "fsdp/worker/shm_communicator.hpp"

namespace fsdp::testing {

// Whether these tests run over shared memory (the default) or Gloo (FSDP_TEST_COMM=gloo).
inline bool testsUseSharedMemory() {
  const char* comm = std::getenv("FSDP_TEST_COMM");
  return comm == nullptr || std::string(comm) != "gloo";
}

struct RankContext {
  worker::Communicator& comm;
  rendezvous::StoreClient& store;
  int rank;
  int world;
  bool sharedMemory = testsUseSharedMemory();  // HYBRID_SHARD's shard groups follow it
};

namespace detail {
// Starts `world` threads, each with a store client and a communicator of its own, hands them
// to `body`, joins them all, then rethrows the first rank's exception.
inline void forEachRank(int world,
                        const std::function<void(int rank, std::unique_ptr<rendezvous::StoreClient>,
                                                 std::unique_ptr<worker::Communicator>)>& body) {
  using namespace std::chrono_literals;
  rendezvous::StoreServer server(rendezvous::ServerOptions{});
  std::vector<std::future<void>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::async(std::launch::async, [&, r] {
      auto store = rendezvous::StoreClient::connect("127.0.0.1", server.port(), {.timeout = 30s});
      auto comm = testsUseSharedMemory()
                      ? worker::createShmCommunicator(
                            *store, {.rank = r, .size = world, .storePrefix = "world", .timeout = 30s})
                      : worker::createGlooCommunicator(
                            *store, {.rank = r, .size = world, .storePrefix = "world", .timeout = 30s});
      body(r, std::move(store), std::move(comm));
    }));
  }
  for (auto& f : ranks) f.wait();
  for (auto& f : ranks) f.get();
}
}  // namespace detail

// Runs body on `world` ranks at once; rethrows the first rank's exception after all joined.
inline void runRanks(int world, const std::function<void(RankContext&)>& body) {
  detail::forEachRank(world, [&](int r, std::unique_ptr<rendezvous::StoreClient> store,
                                 std::unique_ptr<worker::Communicator> comm) {
    RankContext ctx{*comm, *store, r, world};
    body(ctx);
    comm->barrier().wait();
  });
}

// The same with a Runtime per rank (what fsdp::Trainer and Checkpointer take).
inline void runRuntimes(int world, const std::function<void(worker::Runtime&)>& body) {
  detail::forEachRank(world, [&](int r, std::unique_ptr<rendezvous::StoreClient> store,
                                 std::unique_ptr<worker::Communicator> comm) {
    worker::WorkerEnv env;
    env.rank = r;
    env.worldSize = world;
    env.localRank = r;
    env.localWorldSize = world;
    worker::Runtime rt(env, std::move(store), std::move(comm), nullptr,
                       testsUseSharedMemory() ? worker::Backend::kShm : worker::Backend::kGloo);
    body(rt);
    rt.comm().barrier().wait();
  });
}

// Every parameter overwritten from a fixed function of its position: the same on every rank,
// whatever the threads that stand for ranks draw from LibTorch's one global generator.
inline void fillDeterministic(torch::nn::Module& model, double k = 0.1) {
  at::NoGradGuard noGrad;
  for (auto& p : model.parameters()) {
    p.copy_(at::sin(at::arange(p.numel(), at::kFloat).mul(0.37).add(k)).reshape(p.sizes()).mul(0.3));
    k += 0.7;
  }
}

}  // namespace fsdp::testing
