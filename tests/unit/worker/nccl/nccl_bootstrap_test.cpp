// Joining an NCCL group over a fake CUDA/NCCL and a real store on loopback: rank 0 removes the
// unique id's keys on every path; the exchange and the init share one deadline; the whole
// communicator (front, queue, close) wired to the fake. No GPU.
#include "comm/nccl/nccl_bootstrap.hpp"

#include <gtest/gtest.h>

#include <future>

#include "fake_nccl_api.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/store_server.hpp"

namespace {

using namespace std::chrono_literals;
namespace fd = fsdp::worker::detail;
namespace rdzv = fsdp::rendezvous;
using fsdp::testing::FakeNcclApi;

constexpr auto kBootstrapBound = 30s;

struct Store {
  rdzv::StoreServer server{rdzv::ServerOptions{}};
  std::unique_ptr<rdzv::StoreClient> connect() {
    return rdzv::StoreClient::connect("127.0.0.1", server.port(), {.timeout = 30s});
  }
};

fsdp::worker::NcclOptions options(int rank, int size, std::chrono::milliseconds timeout = 30s) {
  return {.rank = rank,
          .size = size,
          .device = 0,
          .storePrefix = "round/1/nccl/world",
          .timeout = timeout};
}

const std::string kKey = "round/1/nccl/world/unique_id";
const std::string kReaders = "round/1/nccl/world/unique_id_readers";

TEST(NcclUniqueId, RankZeroRemovesItsKeysOnceEveryRankReadIt) {
  Store store;
  FakeNcclApi fake;
  std::vector<std::future<std::string>> ranks;
  for (int r = 0; r < 3; ++r) {
    ranks.push_back(std::async(std::launch::async, [&, r] {
      auto client = store.connect();
      return fd::exchangeUniqueId(*client, options(r, 3), fake, fsdp::Deadline::after(30s));
    }));
  }
  std::vector<std::string> ids;
  for (auto& r : ranks) ids.push_back(r.get());
  EXPECT_EQ(ids[0].size(), fd::kNcclUniqueIdBytes);
  EXPECT_EQ(ids[1], ids[0]);
  EXPECT_EQ(ids[2], ids[0]);
  auto client = store.connect();
  EXPECT_FALSE(client->check({kKey}));
  EXPECT_FALSE(client->check({kReaders}));
}

TEST(NcclUniqueId, RankZeroRemovesItsKeysWhenARankNeverReadsIt) {
  Store store;
  FakeNcclApi fake;
  // Of three ranks, rank 1 reads the id and rank 2 never comes.
  auto reader = std::async(std::launch::async, [&] {
    auto client = store.connect();
    return fd::exchangeUniqueId(*client, options(1, 3), fake, fsdp::Deadline::after(30s));
  });
  auto client = store.connect();
  try {
    fd::exchangeUniqueId(*client, options(0, 3, 300ms), fake, fsdp::Deadline::after(300ms));
    FAIL() << "rank 0 must time out";
  } catch (const fsdp::TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("NCCL unique id under '" + kKey +
                                         "': not every rank of 3 read it"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(reader.get().size(), fd::kNcclUniqueIdBytes);
  EXPECT_FALSE(client->check({kKey})) << "a later reader must not find this id";
  EXPECT_FALSE(client->check({kReaders}));
}

TEST(NcclBootstrap, InitGetsWhatIsLeftOfTheExchangesDeadlineNotATimeoutOfItsOwn) {
  Store store;
  FakeNcclApi fake;
  // Every poll waits a millisecond at least: 10000 polls outlast the 300 ms deadline by far.
  fake.setInitNeverSettles(10000);
  auto client = store.connect();
  client->set(kKey, std::string(fd::kNcclUniqueIdBytes, 'x'));  // rank 0 published it
  // The options' timeout is a minute; the deadline, the one create() takes from it at the start,
  // has 300 ms left when init begins.
  try {
    fd::joinNcclGroup(*client, options(1, 2, 60s), fake, fsdp::Deadline::after(300ms));
    FAIL() << "init must time out";
  } catch (const fsdp::TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("ncclCommInitRank on rank 1 of 2 (cuda:0) did not finish"),
              std::string::npos)
        << e.what();
  } catch (const fsdp::Error& e) {
    FAIL() << "init polled past the deadline it shares with the exchange: " << e.what();
  }
  EXPECT_EQ(fake.counts().aborts, 1) << "the half-made communicator is aborted";
}

TEST(NcclBootstrap, TheExchangeWaitsOnlyUntilTheSharedDeadline) {
  Store store;
  FakeNcclApi fake;
  auto client = store.connect();
  // Rank 0 never publishes. The options say a minute; the deadline says 300 ms.
  auto joined = std::async(std::launch::async, [&] {
    fd::joinNcclGroup(*client, options(1, 2, 60s), fake, fsdp::Deadline::after(300ms));
  });
  ASSERT_EQ(joined.wait_for(kBootstrapBound), std::future_status::ready)
      << "the exchange waited by the options' timeout, not by the deadline";
  EXPECT_THROW(joined.get(), fsdp::TimeoutError);
  EXPECT_EQ(fake.counts().aborts, 0) << "no communicator was made";
}

TEST(NcclBootstrap, AFailedInitAbortsTheHalfMadeCommunicatorAndNamesTheRank) {
  Store store;
  FakeNcclApi fake;
  fake.setInitFails("invalid usage (fake)");
  auto client = store.connect();
  try {
    fd::joinNcclGroup(*client, options(0, 1), fake, fsdp::Deadline::after(30s));
    FAIL() << "init must fail";
  } catch (const fsdp::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "ncclCommInitRank on rank 0 of 1 (cuda:0): invalid usage (fake)");
  }
  EXPECT_EQ(fake.counts().aborts, 1);
  EXPECT_FALSE(client->check({kKey}));
}

TEST(NcclCommunicatorOverFakes, ABarrierRunsAndTheCloseFinalizesAndFreesEverything) {
  Store store;
  auto fake = std::make_shared<FakeNcclApi>();
  fake->setAutoReach(true);
  auto client = store.connect();
  {
    auto comm =
        fd::createNcclCommunicator(*client, options(0, 1), fake, fsdp::Deadline::after(30s));
    EXPECT_STREQ(comm->backendName(), "NCCL");
    for (int i = 0; i < 3; ++i) comm->barrier().wait();
  }
  const auto c = fake->counts();
  EXPECT_EQ(c.collectives, 3);
  EXPECT_EQ(c.finalizes, 1);
  EXPECT_EQ(c.destroys, 1);
  EXPECT_EQ(c.aborts, 0);
  EXPECT_EQ(c.streamsDestroyed, c.streamsCreated);
  EXPECT_EQ(c.released, c.allocated);
  EXPECT_EQ(c.eventsDestroyed, c.eventsCreated);
  EXPECT_EQ(c.callsAfterAbort, 0);
}

// NCCL up to 2.28 leaves the tail of an average at one rank unwritten (nccl_api.hpp): there the
// communicator asks for a sum, the same bits; every other reduction, and an average of two ranks
// or more, goes to NCCL as asked.
TEST(NcclReduction, AnAverageAtOneRankIsASumAndEverythingElseIsAsAsked) {
  using fsdp::worker::ReduceOp;
  EXPECT_EQ(fd::ncclReduction(ReduceOp::kAverage, 1), ReduceOp::kSum);
  for (const int world : {1, 2, 3, 8}) {
    EXPECT_EQ(fd::ncclReduction(ReduceOp::kSum, world), ReduceOp::kSum) << world;
    EXPECT_EQ(fd::ncclReduction(ReduceOp::kMax, world), ReduceOp::kMax) << world;
    if (world > 1) {
      EXPECT_EQ(fd::ncclReduction(ReduceOp::kAverage, world), ReduceOp::kAverage) << world;
    }
  }
}

TEST(NcclCommunicatorOverFakes, ADeviceThatIsNotVisibleIsAConfigErrorBeforeTheStore) {
  Store store;
  auto fake = std::make_shared<FakeNcclApi>();
  auto client = store.connect();
  auto o = options(0, 2);
  o.device = 3;
  EXPECT_THROW(fd::createNcclCommunicator(*client, o, fake, fsdp::Deadline::after(30s)),
               fsdp::ConfigError);
  EXPECT_FALSE(client->check({kKey}));
}

}  // namespace
