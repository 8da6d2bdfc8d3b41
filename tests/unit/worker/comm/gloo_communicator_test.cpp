// The Gloo communicator with 1-4 ranks as threads of this process, over a real store
// server and Gloo's TCP transport on loopback.
#include "fsdp/worker/gloo_communicator.hpp"
#include "communicator_checks.hpp"

#include <ATen/Functions.h>
#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "fsdp/worker/runtime.hpp"

namespace fsdp::worker {
namespace {

using namespace std::chrono_literals;

// Runs body(comm) on `world` ranks at once, each with its own store client and communicator.
void runRanks(int world, const std::string& prefix,
              const std::function<void(Communicator&)>& body) {
  rendezvous::StoreServer server(rendezvous::ServerOptions{});
  std::vector<std::future<void>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::async(std::launch::async, [&, r] {
      auto store = rendezvous::StoreClient::connect("127.0.0.1", server.port(), {.timeout = 30s});
      auto comm = createGlooCommunicator(
          *store, {.rank = r, .size = world, .storePrefix = prefix, .timeout = 30s});
      body(*comm);
      // Gloo's halving-doubling reduce-scatter can leave a peer's last notification unread;
      // closing the pairs then resets connections a slower rank still reads from.
      comm->barrier().wait();
    }));
  }
  for (auto& f : ranks) f.get();  // rethrows a rank's failure
}

class GlooWorld : public ::testing::TestWithParam<int> {};

TEST_P(GlooWorld, ReduceScatterOfUnevenSizesSumsAndAverages) {
  const int w = GetParam();
  runRanks(w, "rs", [w](Communicator& comm) {
    const int r = comm.rank();
    for (const std::int64_t total : {1L, 5L, 13L, 4096L + 3}) {
      const auto counts = chunkSizes(total, w);
      std::int64_t offset = 0;
      for (int i = 0; i < r; ++i) offset += counts[i];
      const auto input = at::arange(total, at::kDouble).mul_(r + 1);
      auto out = at::empty({counts[r]}, at::kDouble);
      comm.reduceScatter(input, out).wait();
      const auto expected = at::arange(offset, offset + counts[r], at::kDouble).mul_(w * (w + 1) / 2.0);
      EXPECT_TRUE(at::allclose(out, expected)) << "world " << w << " total " << total << " rank " << r;
      comm.reduceScatter(input, out, ReduceOp::kAverage).wait();
      EXPECT_TRUE(at::allclose(out, expected / w));
    }
  });
}

TEST_P(GlooWorld, AllGatherOfUnevenSizesConcatenatesInRankOrder) {
  const int w = GetParam();
  runRanks(w, "ag", [w](Communicator& comm) {
    const int r = comm.rank();
    for (const std::int64_t total : {static_cast<std::int64_t>(w), 7L, 1001L}) {
      const auto counts = chunkSizes(total, w);
      std::int64_t offset = 0;
      for (int i = 0; i < r; ++i) offset += counts[i];
      auto out = at::empty({total}, at::kFloat);
      comm.allGather(at::arange(offset, offset + counts[r], at::kFloat), out).wait();
      EXPECT_TRUE(at::equal(out, at::arange(total, at::kFloat))) << "total " << total;
    }
  });
}

TEST_P(GlooWorld, EveryOperationEqualsTheLocalResultForEveryDtypeAndUnevenSizes) {
  const int w = GetParam();
  runRanks(w, "every", [w](Communicator& comm) { fsdp::testing::checkEveryOperation(comm, comm.rank(), w, /*oneRounding=*/false); });
}

TEST_P(GlooWorld, AllReduceBroadcastAndBarrier) {
  const int w = GetParam();
  runRanks(w, "ar", [w](Communicator& comm) {
    const int r = comm.rank();
    auto t = at::full({9}, static_cast<float>(r + 1));
    auto u = at::full({3}, static_cast<std::int64_t>(r), at::kLong);
    // Two operations in flight at once, waited in reverse order.
    auto w1 = comm.allReduce(t);
    auto w2 = comm.allReduce(u, ReduceOp::kMin);
    w2.wait();
    w1.wait();
    EXPECT_TRUE(at::allclose(t, at::full({9}, w * (w + 1) / 2.0f)));
    EXPECT_TRUE(at::equal(u, at::zeros({3}, at::kLong)));
    auto b = at::full({4}, static_cast<double>(r), at::kDouble);
    comm.broadcast(b, w - 1).wait();
    EXPECT_TRUE(at::equal(b, at::full({4}, static_cast<double>(w - 1), at::kDouble)));
    comm.barrier().wait();
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooWorld, ::testing::Values(1, 2, 3, 4));

TEST(GlooCommunicator, MismatchedSizesAreRejectedBeforeAnyCommunication) {
  runRanks(1, "bad", [](Communicator& comm) {
    auto out = at::empty({4});
    EXPECT_THROW(comm.allGather(at::empty({3}), out), Error);
    EXPECT_THROW(comm.reduceScatter(at::empty({4}), at::empty({3})), Error);
    EXPECT_THROW(comm.allReduce(at::empty({4}).t().contiguous().expand({2, 4})), Error);
    EXPECT_THROW(comm.allReduce(at::empty({2}, at::kBool)), Error);
    EXPECT_THROW(comm.allGather(at::empty({4}, at::kDouble), out), Error);
  });
}

TEST(GlooCommunicator, AMissingPeerIsATimeoutNamingTheStore) {
  rendezvous::StoreServer server(rendezvous::ServerOptions{});
  auto store = rendezvous::StoreClient::connect("127.0.0.1", server.port());
  // Rank 0 of 2; rank 1 never comes.
  EXPECT_THROW(createGlooCommunicator(*store, {.rank = 0, .size = 2, .timeout = 300ms}), Error);
}

TEST(WorkerEnv, NamesMissingAndInconsistentVariables) {
  std::map<std::string, std::string> env = {
      {"RANK", "1"}, {"LOCAL_RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"},
      {"FSDPRUN_STORE_ADDR", "127.0.0.1"}, {"FSDPRUN_STORE_PORT", "29500"}, {"FSDPRUN_ROUND", "3"}};
  const auto ok = WorkerEnv::fromEnvironment(mapEnv(env));
  EXPECT_EQ(ok.rank, 1);
  EXPECT_EQ(ok.round, 3);
  auto bad = env;
  bad["RANK"] = "2";
  EXPECT_THROW(WorkerEnv::fromEnvironment(mapEnv(bad)), ConfigError);
  bad = env;
  bad.erase("FSDPRUN_STORE_PORT");
  try {
    WorkerEnv::fromEnvironment(mapEnv(bad));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("FSDPRUN_STORE_PORT"), std::string::npos);
  }
}

}  // namespace
}  // namespace fsdp::worker
