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
#include "fsdp/worker/shm_communicator.hpp"

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

// Rank r's input for a seed: values that make every reduction's order visible in fp32.
at::Tensor inputOf(int rank, std::int64_t n, at::ScalarType type, int seed) {
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(seed * 131 + rank));
  auto values = at::randn({n}, gen);
  if (at::isIntegralType(type, false)) values = values.mul(50).round();
  return values.to(type);
}

class ShmWorld : public ::testing::TestWithParam<int> {};

TEST_P(ShmWorld, EveryOperationEqualsTheLocalResultForEveryDtypeAndUnevenSizes) {
  const int world = GetParam();
  // 4 KiB slots: a few hundred elements per block, so 10,007 elements take many blocks.
  runShm(world, 4096, [world](fw::Communicator& comm, int rank) {
    for (const auto type : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong}) {
      for (const std::int64_t n : {0L, 1L, 7L, 1001L, 10007L}) {
        SCOPED_TRACE(std::string(c10::toString(type)) + " n=" + std::to_string(n) + " rank " + std::to_string(rank));
        const auto counts = fw::chunkSizes(n, world);
        std::int64_t offset = 0;
        for (int r = 0; r < rank; ++r) offset += counts[static_cast<std::size_t>(r)];
        const auto mine = counts[static_cast<std::size_t>(rank)];
        std::vector<at::Tensor> all;
        for (int r = 0; r < world; ++r) all.push_back(inputOf(r, n, type, 1));
        // The expected reductions, in fp32 (fp64 for doubles) with one rounding, as promised.
        const auto acc = type == at::kDouble ? at::kDouble : (at::isIntegralType(type, false) ? at::kLong : at::kFloat);
        auto sum = at::zeros({n}, acc), mx = all[0].to(acc), mn = all[0].to(acc);
        for (const auto& t : all) {
          sum.add_(t.to(acc));
          mx = at::maximum(mx, t.to(acc));
          mn = at::minimum(mn, t.to(acc));
        }
        const double tol = type == at::kBFloat16 ? 1e-2 : (type == at::kHalf ? 1e-3 : 1e-6);
        const auto close = [&](const at::Tensor& got, const at::Tensor& want) {
          return at::allclose(got.to(at::kDouble), want.to(type).to(at::kDouble), tol, tol);
        };

        auto out = at::empty({mine}, all[0].options());
        comm.reduceScatter(all[static_cast<std::size_t>(rank)], out, fw::ReduceOp::kSum).wait();
        EXPECT_TRUE(close(out, sum.narrow(0, offset, mine))) << "reduceScatter sum";
        if (at::isFloatingType(type)) {
          comm.reduceScatter(all[static_cast<std::size_t>(rank)], out, fw::ReduceOp::kAverage).wait();
          EXPECT_TRUE(close(out, sum.narrow(0, offset, mine).div(world))) << "reduceScatter average";
        }
        comm.reduceScatter(all[static_cast<std::size_t>(rank)], out, fw::ReduceOp::kMax).wait();
        EXPECT_TRUE(close(out, mx.narrow(0, offset, mine))) << "reduceScatter max";

        auto gathered = at::empty({n}, all[0].options());
        comm.allGather(all[static_cast<std::size_t>(rank)].narrow(0, offset, mine).contiguous(), gathered).wait();
        at::Tensor expectGather = at::empty({n}, all[0].options());
        for (int r = 0; r < world; ++r) {
          std::int64_t o = 0;
          for (int q = 0; q < r; ++q) o += counts[static_cast<std::size_t>(q)];
          expectGather.narrow(0, o, counts[static_cast<std::size_t>(r)]).copy_(all[static_cast<std::size_t>(r)].narrow(0, o, counts[static_cast<std::size_t>(r)]));
        }
        EXPECT_TRUE(at::equal(gathered, expectGather)) << "allGather";

        auto reduced = all[static_cast<std::size_t>(rank)].clone();
        comm.allReduce(reduced, fw::ReduceOp::kSum).wait();
        EXPECT_TRUE(close(reduced, sum)) << "allReduce sum";
        auto smallest = all[static_cast<std::size_t>(rank)].clone();
        comm.allReduce(smallest, fw::ReduceOp::kMin).wait();
        EXPECT_TRUE(close(smallest, mn)) << "allReduce min";

        auto b = all[static_cast<std::size_t>(rank)].clone();
        comm.broadcast(b, world - 1).wait();
        EXPECT_TRUE(at::equal(b, all[static_cast<std::size_t>(world - 1)])) << "broadcast";
        comm.barrier().wait();
      }
    }
  });
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

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmWorld, ::testing::Values(1, 2, 3, 4));

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
  runShm(2, 4096, [&](fw::Communicator& comm, int rank) {
    if (rank == 1) {
      // Rank 1 joins late (past rank 0's timeout), then finds the group aborted.
      std::this_thread::sleep_for(1500ms);
    }
    try {
      comm.barrier().wait();
      if (rank == 0) ADD_FAILURE() << "rank 0's barrier passed without rank 1";
    } catch (const fsdp::Error& e) {
      if (rank == 1) {
        EXPECT_NE(std::string(e.what()).find("aborted by rank 0"), std::string::npos) << e.what();
      }
    }
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
