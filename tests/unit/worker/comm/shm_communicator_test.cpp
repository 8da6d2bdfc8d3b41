// The shared-memory communicator against values computed locally: every operation, every dtype,
// sizes that do not divide by the world and blocks far smaller than the tensors (many barriers
// per operation), world sizes 1-4 as threads over one real segment; then its failures.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <future>
#include <random>

#include <unistd.h>

#include "fsdp/common/error.hpp"
#include "fsdp/common/shm.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "fsdp/worker/gloo_communicator.hpp"
#include "fsdp/worker/hierarchical_communicator.hpp"
#include "fsdp/worker/shm_communicator.hpp"
#include "communicator_checks.hpp"

namespace {

using namespace std::chrono_literals;
namespace fw = fsdp::worker;

// Runs body(comm, rank) on `world` threads, each with its own store client and communicator.
void runShm(int world, std::size_t slotBytes, const std::function<void(fw::Communicator&, int)>& body,
            std::chrono::milliseconds timeout = 30s, const std::string& runId = "unit-test") {
  fsdp::rendezvous::StoreServer server(fsdp::rendezvous::ServerOptions{});
  std::vector<std::future<void>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::async(std::launch::async, [&, r] {
      auto store = fsdp::rendezvous::StoreClient::connect("127.0.0.1", server.port(), {.timeout = 30s});
      auto comm = fw::createShmCommunicator(*store, {.rank = r,
                                                     .size = world,
                                                     .storePrefix = "shm",
                                                     .runId = runId,
                                                     .slotBytes = slotBytes,
                                                     .timeout = timeout});
      body(*comm, r);
    }));
  }
  for (auto& f : ranks) f.wait();
  for (auto& f : ranks) f.get();
}

class ShmWorld : public ::testing::TestWithParam<int> {};

TEST_P(ShmWorld, EveryOperationEqualsTheLocalResultForEveryDtypeAndUnevenSizes) {
  const int world = GetParam();
  // 4 KiB slots: a few hundred elements per block, so 10,007 elements take many blocks.
  runShm(world, 4096, [world](fw::Communicator& comm, int rank) { fsdp::testing::checkEveryOperation(comm, rank, world); });
}

TEST_P(ShmWorld, BigTensorsWithTheDefaultSlotsAndEveryRankGetsTheSameSum) {
  const int world = GetParam();
  runShm(world, std::size_t{4} << 20, [world](fw::Communicator& comm, int rank) {
    const std::int64_t n = (std::int64_t{3} << 20) + 5;  // 12 MB of fp32, several blocks
    auto t = at::full({n}, static_cast<float>(rank + 1));
    comm.allReduce(t).wait();
    EXPECT_EQ(t.min().item<float>(), world * (world + 1) / 2.0F);
    EXPECT_EQ(t.max().item<float>(), world * (world + 1) / 2.0F);
  });
}

// Outputs of 8 MB and more take the streaming paths (non-temporal stores; reduce-scatter of
// fp32 fused into one pass over a power-of-two group): bit-identical to the same sums made
// with ATen in the communicator's order (own chunk, then the others by rank, then / world),
// with uneven chunks and outputs that start off a 16-byte boundary.
TEST_P(ShmWorld, LargeOutputsTakeTheStreamingPathsAndEqualTheLocalSumsBitForBit) {
  const int world = GetParam();
  if (world == 1) GTEST_SKIP() << "one rank copies";
  const std::uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto inputOf = [seed](int r, std::int64_t n) {
    return at::randn({n}, at::detail::createCPUGenerator(seed + static_cast<std::uint64_t>(r)));
  };
  const std::int64_t gatherEach = (std::int64_t{3} << 20) + 7;                 // 12 MB per rank
  const std::int64_t scatterTotal = world * ((std::int64_t{5} << 19) + 3) + 1;  // 10 MB chunks
  runShm(world, std::size_t{512} << 10, [&](fw::Communicator& comm, int rank) {
    // All-gather: every rank's input, in rank order.
    const std::int64_t gatherTotal = gatherEach * world - 3;
    const auto gatherCounts = fw::chunkSizes(gatherTotal, world);
    auto gatherStore = at::empty({gatherTotal + 1});
    auto gathered = gatherStore.narrow(0, 1, gatherTotal);  // 4 bytes off alignment
    comm.allGather(inputOf(rank, gatherCounts[static_cast<std::size_t>(rank)]), gathered).wait();
    std::vector<at::Tensor> pieces;
    for (int r = 0; r < world; ++r) pieces.push_back(inputOf(r, gatherCounts[static_cast<std::size_t>(r)]));
    EXPECT_TRUE(at::equal(gathered, at::cat(pieces))) << "allGather, rank " << rank;

    // Reduce-scatter, sum and average.
    const auto counts = fw::chunkSizes(scatterTotal, world);
    const auto offsets = fw::chunkOffsets(counts);
    const auto mine = [&](int r) {
      return inputOf(100 + r, scatterTotal)
          .narrow(0, offsets[static_cast<std::size_t>(rank)], counts[static_cast<std::size_t>(rank)]);
    };
    for (const auto op : {fw::ReduceOp::kSum, fw::ReduceOp::kAverage}) {
      auto outStore = at::empty({counts[static_cast<std::size_t>(rank)] + 1});
      auto out = outStore.narrow(0, 1, counts[static_cast<std::size_t>(rank)]);
      comm.reduceScatter(inputOf(100 + rank, scatterTotal), out, op).wait();
      auto expected = mine(rank) + mine(rank == 0 ? 1 : 0);
      for (int r = 0; r < world; ++r) {
        if (r != rank && r != (rank == 0 ? 1 : 0)) expected.add_(mine(r));
      }
      if (op == fw::ReduceOp::kAverage) expected.div_(world);
      EXPECT_TRUE(at::equal(out, expected)) << "reduceScatter " << (op == fw::ReduceOp::kSum ? "sum" : "average")
                                            << ", rank " << rank;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmWorld, ::testing::Values(1, 2, 3, 4));

// Several nodes: shared memory inside each (threads stand for the node's ranks) and Gloo
// across, as fsdp::init() builds them; the same checks on the world they make.
class HierarchicalWorld : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(HierarchicalWorld, EveryOperationEqualsTheLocalResultForEveryDtypeAndUnevenSizes) {
  const auto [nodes, perNode] = GetParam();
  const int world = nodes * perNode;
  fsdp::rendezvous::StoreServer server(fsdp::rendezvous::ServerOptions{});
  std::vector<std::future<void>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::async(std::launch::async, [&, r] {
      auto store = fsdp::rendezvous::StoreClient::connect("127.0.0.1", server.port(), {.timeout = 30s});
      const int node = r / perNode, local = r % perNode;
      auto inside = fw::createShmCommunicator(*store, {.rank = local,
                                                       .size = perNode,
                                                       .storePrefix = "node/" + std::to_string(node),
                                                       .slotBytes = 4096,
                                                       .timeout = 30s});
      auto across = fw::createGlooCommunicator(
          *store, {.rank = node, .size = nodes, .storePrefix = "cross/" + std::to_string(local), .timeout = 30s});
      auto comm = fw::makeHierarchicalCommunicator(std::move(inside), std::move(across));
      ASSERT_EQ(comm->rank(), r);
      ASSERT_EQ(comm->size(), world);
      fsdp::testing::checkEveryOperation(*comm, r, world, /*oneRounding=*/nodes == 1);
    }));
  }
  for (auto& f : ranks) f.wait();
  for (auto& f : ranks) f.get();
}

INSTANTIATE_TEST_SUITE_P(NodesTimesRanks, HierarchicalWorld,
                         ::testing::Values(std::pair{2, 2}, std::pair{3, 2}, std::pair{2, 3}, std::pair{1, 3},
                                           std::pair{3, 1}));

TEST(ShmCommunicator, NothingIsLeftInDevShmOnceEveryRankAttached) {
  const std::string runId = "leftover-check-" + std::to_string(::getpid());
  runShm(3, 4096, [&](fw::Communicator& comm, int) {
    comm.barrier().wait();
    EXPECT_EQ(fsdp::removeShmSegments(runId, ::getppid()), 0) << "the segment's name outlived the attach";
  }, 30s, runId);
}

TEST(ShmCommunicator, MismatchedSizesAreRejectedBeforeAnyCommunication) {
  runShm(2, 4096, [](fw::Communicator& comm, int rank) {
    auto out = at::empty({3});
    EXPECT_THROW(comm.reduceScatter(at::ones({10}), out).wait(), fsdp::Error);  // 5 expected
    EXPECT_THROW(comm.allGather(at::ones({4}), at::empty({10})).wait(), fsdp::Error);
    EXPECT_THROW(comm.allReduce(at::ones({4}, at::kBool)).wait(), fsdp::Error);
    EXPECT_THROW(comm.broadcast(at::ones({4}), 2).wait(), fsdp::Error);
    // Refusals abort nothing: the group still works.
    auto t = at::full({5}, static_cast<float>(rank));
    comm.allReduce(t).wait();
    EXPECT_EQ(t[0].item<float>(), 1.0F);
  });
}

TEST(ShmCommunicator, ARankThatNeverArrivesIsATimeoutNamingIt) {
  std::string message;
  runShm(3, 4096, [&](fw::Communicator& comm, int rank) {
    if (rank == 2) return;  // never issues anything
    try {
      comm.allReduce(at::ones({100})).wait();
      ADD_FAILURE() << "rank " << rank << " finished an all-reduce that rank 2 never joined";
    } catch (const fsdp::Error& e) {
      if (rank == 0) message = e.what();
    }
  }, 500ms);
  // Rank 0 either timed out itself, naming rank 2, or saw rank 1 give up on it.
  EXPECT_NE(message.find("rank(s) 2 never arrived"), std::string::npos) << message;
}

TEST(ShmCommunicator, AfterAFailureEveryLaterOperationSaysWhoGaveUpAndWhy) {
  std::promise<void> rankZeroDone;
  auto gaveUp = rankZeroDone.get_future();
  runShm(2, 4096, [&](fw::Communicator& comm, int rank) {
    if (rank == 1) {
      // Rank 1 joins once rank 0 has given up on it (its timeout), then finds the group aborted.
      ASSERT_EQ(gaveUp.wait_for(60s), std::future_status::ready);
    }
    try {
      comm.barrier().wait();
      if (rank == 0) ADD_FAILURE() << "rank 0's barrier passed without rank 1";
    } catch (const fsdp::Error& e) {
      if (rank == 1) {
        EXPECT_NE(std::string(e.what()).find("aborted by rank 0"), std::string::npos) << e.what();
      }
    }
    if (rank == 0) rankZeroDone.set_value();
    EXPECT_THROW(comm.allReduce(at::ones({4})).wait(), fsdp::Error);
  }, 500ms);
}

TEST(ShmCommunicator, BadOptionsAreConfigErrors) {
  fsdp::rendezvous::StoreServer server(fsdp::rendezvous::ServerOptions{});
  auto store = fsdp::rendezvous::StoreClient::connect("127.0.0.1", server.port(), {.timeout = 10s});
  EXPECT_THROW(fw::createShmCommunicator(*store, {.rank = 2, .size = 2}), fsdp::ConfigError);
  EXPECT_THROW(fw::createShmCommunicator(*store, {.rank = 0, .size = 1, .slotBytes = 100}), fsdp::ConfigError);
}

TEST(ShmSegments, PrefixIsTheSanitisedRunIdAndRemovalFindsOnlyThatJob) {
  EXPECT_EQ(fsdp::shmSegmentPrefix("job/1 a", 42), "fsdprun-job_1_a-42-");
  EXPECT_EQ(fsdp::removeShmSegments("no-such-job", ::getpid()), 0);
}

}  // namespace
