// A re-formed round shrinking the last round's NCCL communicator (ncclCommRevoke, then
// ncclCommShrink, NCCL 2.28+), over the fake CUDA/NCCL and a real store on loopback: the abort
// revokes instead of aborting where the library can, and falls back to the abort where the revoke
// fails or hangs; rank 0 plans a shrink only where every rank holds the same communicator, in its
// old order, and a rank was lost (a seeded, generated series against a reference rule); the plan's
// keys go; a shrunk communicator steps. No GPU.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <future>
#include <numeric>
#include <random>

#include "comm/nccl/nccl_bootstrap.hpp"
#include "comm/nccl/nccl_queue.hpp"
#include "fake_nccl_api.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "fsdp/worker/nccl_communicator.hpp"

namespace {

using namespace std::chrono_literals;
namespace fd = fsdp::worker::detail;
namespace rdzv = fsdp::rendezvous;
using fsdp::testing::FakeNcclApi;
using fsdp::testing::waitOutcome;

constexpr auto kShrinkBound = 30s;

std::unique_ptr<fd::NcclQueue> queueOn(const std::shared_ptr<FakeNcclApi>& fake, fd::NcclComm comm,
                                       std::chrono::milliseconds timeout = 60s) {
  return std::make_unique<fd::NcclQueue>(fake, comm, fake->createStream().handle,
                                         fd::NcclQueueOptions{0, 2, 0, timeout});
}

fsdp::worker::Work launch(fd::NcclQueue& queue, const std::shared_ptr<FakeNcclApi>& fake) {
  return queue.launch("allReduce", {at::ones({4})}, [f = fake](fd::NcclComm c, fd::CudaStream s) {
    return f->allReduce(nullptr, nullptr, 1, at::kFloat, fsdp::worker::ReduceOp::kSum, c, s);
  }, fd::WaitMode::kHost);
}

}  // namespace

// The agent's abort notice on NCCL 2.28+: the operation in flight wakes its waiter with
// CommAborted as before, but the communicator is revoked, not aborted, and handed over once.
TEST(NcclRevoke, OnALibraryThatShrinksAnAbortRevokesAndKeepsTheCommunicatorForTheNextRound) {
  auto fake = std::make_shared<FakeNcclApi>();
  fake->setShrinkSupported(true);
  const auto comm = fake->newComm();
  auto queue = queueOn(fake, comm);
  auto work = launch(*queue, fake);  // never reached: in flight
  auto waiter = std::async(std::launch::async, [&] { return waitOutcome(work); });
  EXPECT_TRUE(queue->abort("rank 2 failed (test)"));
  ASSERT_EQ(waiter.wait_for(kShrinkBound), std::future_status::ready);
  EXPECT_EQ(waiter.get(), "CommAborted");
  EXPECT_THROW(launch(*queue, fake), fsdp::CommAborted);
  EXPECT_EQ(fake->counts().revokes, 1);
  EXPECT_EQ(fake->counts().aborts, 0);
  EXPECT_EQ(queue->takeRevoked(), comm);
  EXPECT_EQ(queue->takeRevoked(), nullptr) << "handed over once";
  queue.reset();
  EXPECT_EQ(fake->counts().aborts, 0) << "the taker owns it now";
  EXPECT_EQ(fake->counts().finalizes, 0);
  EXPECT_EQ(fake->counts().callsAfterAbort, 0);
}

TEST(NcclRevoke, ARevokedCommunicatorNobodyTookIsAbortedAtTheClose) {
  auto fake = std::make_shared<FakeNcclApi>();
  fake->setShrinkSupported(true);
  const auto comm = fake->newComm();
  auto queue = queueOn(fake, comm);
  EXPECT_TRUE(queue->abort("test"));
  queue.reset();
  EXPECT_EQ(fake->counts().aborts, 1);
  EXPECT_TRUE(fake->isAborted(comm));
  EXPECT_EQ(fake->counts().callsAfterAbort, 0);
}

// A revoke that fails, or never settles, is followed by the abort: nothing to shrink, waiters
// still woken with CommAborted.
TEST(NcclRevoke, ARevokeThatFailsOrNeverSettlesEndsInTheAbort) {
  for (const bool hangs : {false, true}) {
    SCOPED_TRACE(hangs ? "never settles" : "fails");
    auto fake = std::make_shared<FakeNcclApi>();
    fake->setShrinkSupported(true);
    if (hangs) {
      fake->setRevokeNeverSettles();
    } else {
      fake->setRevokeFails("internal error (fake)");
    }
    const auto comm = fake->newComm();
    auto queue = queueOn(fake, comm, 300ms);  // the revoke's bound is the smaller of it and 30 s
    auto work = launch(*queue, fake);
    EXPECT_TRUE(queue->abort("test"));
    EXPECT_EQ(waitOutcome(work), "CommAborted");
    EXPECT_EQ(fake->counts().revokes, 1);
    EXPECT_EQ(fake->counts().aborts, 1);
    EXPECT_EQ(queue->takeRevoked(), nullptr);
    queue.reset();
    EXPECT_EQ(fake->counts().aborts, 1) << "aborted once";
  }
}

// Where the communicator failed before the notice (its own error, a deadline), the failure
// aborted it: the notice revokes nothing, and there is nothing to shrink. On an older library
// the abort is the abort.
TEST(NcclRevoke, AFailureFirstOrAnOlderLibraryLeavesNothingToShrink) {
  {
    auto fake = std::make_shared<FakeNcclApi>();
    fake->setShrinkSupported(true);
    const auto comm = fake->newComm();
    auto queue = queueOn(fake, comm);
    auto work = launch(*queue, fake);
    fake->setAsyncError(comm, "remote process exited (fake)");
    EXPECT_NE(waitOutcome(work).find("remote process exited (fake)"), std::string::npos);
    queue->abort("test");
    EXPECT_EQ(fake->counts().revokes, 0);
    EXPECT_EQ(queue->takeRevoked(), nullptr);
  }
  {
    auto fake = std::make_shared<FakeNcclApi>();
    auto queue = queueOn(fake, fake->newComm());
    EXPECT_TRUE(queue->abort("test"));
    EXPECT_EQ(fake->counts().revokes, 0);
    EXPECT_EQ(fake->counts().aborts, 1);
    EXPECT_EQ(queue->takeRevoked(), nullptr);
  }
}

// The real library's lookup (no device needed): ncclCommRevoke and ncclCommShrink are found
// exactly where the loaded NCCL is 2.28 or later.
TEST(NcclRevoke, TheLoadedLibraryShrinksExactlyFromNccl228) {
  if (!fsdp::worker::ncclAvailable()) GTEST_SKIP() << "this libfsdp was built without NCCL";
  const int version = fd::ncclLibraryVersion();
  ASSERT_GT(version, 0);
  const char* off = std::getenv("FSDP_NCCL_SHRINK");
  if (off != nullptr && std::string(off) == "0") GTEST_SKIP() << "FSDP_NCCL_SHRINK=0";
  EXPECT_EQ(fd::cudaNcclApi()->canShrink(), version >= 22800) << "NCCL " << version;
}

namespace {

// One rank of a re-formed round: the parent it holds (none: a new process), as the generator
// drew it.
struct Held {
  int rank = -1;  // in the parent; -1: no parent
  int size = 0;
  std::string prefix;
};

struct RoundResult {
  std::vector<int> shrinks;  // per new rank: 1 shrank, 0 initialised from an id
  std::vector<std::vector<int>> excluded;
  int parentsAborted = 0;
  std::vector<std::string> errors;
  bool keysLeft = false;
};

// Runs joinNcclGroup on one thread per rank of the new round, each with its parent.
RoundResult joinRound(const std::vector<Held>& ranks, bool announce = true) {
  rdzv::StoreServer server{rdzv::ServerOptions{}};
  auto fake = std::make_shared<FakeNcclApi>();
  fake->setShrinkSupported(true);
  const int world = static_cast<int>(ranks.size());
  std::vector<fd::NcclComm> parents(ranks.size(), nullptr);
  std::vector<std::future<std::string>> threads;
  for (int r = 0; r < world; ++r) {
    std::unique_ptr<fd::NcclParent> parent;
    if (ranks[r].rank >= 0) {
      parents[r] = fake->newComm();
      fake->commRevoke(parents[r]);  // what the abort left
      parent = std::make_unique<fd::NcclParent>(fake, parents[r], ranks[r].rank, ranks[r].size, 0, ranks[r].prefix);
    }
    threads.push_back(std::async(std::launch::async, [&, r, p = std::move(parent)]() mutable -> std::string {
      auto client = rdzv::StoreClient::connect("127.0.0.1", server.port(), {.timeout = kShrinkBound});
      try {
        fd::joinNcclGroup(*client,
                          {.rank = r, .size = world, .device = 0, .storePrefix = "round/2/nccl/world", .timeout = kShrinkBound},
                          *fake, fsdp::Deadline::after(kShrinkBound), std::move(p), announce);
        return "";
      } catch (const std::exception& e) {
        return e.what();
      }
    }));
  }
  RoundResult result;
  for (auto& t : threads) {
    if (auto e = t.get(); !e.empty()) result.errors.push_back(e);
  }
  for (const auto& [parent, exclude] : fake->shrinks()) result.excluded.push_back(exclude);
  for (const auto parent : parents) result.parentsAborted += parent != nullptr && fake->isAborted(parent);
  const auto counts = fake->counts();
  result.shrinks.assign(1, counts.shrinks);
  result.shrinks.push_back(counts.inits);
  auto client = rdzv::StoreClient::connect("127.0.0.1", server.port(), {.timeout = kShrinkBound});
  result.keysLeft = client->numKeys() != 0;
  return result;
}

// The rule, written apart from the code: shrink where every rank holds a parent of the same
// size and prefix, their old ranks rise with the new ones, and fewer ranks than the parent's.
std::optional<std::vector<int>> reference(const std::vector<Held>& ranks) {
  const auto& first = ranks.front();
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const auto& h = ranks[r];
    if (h.rank < 0 || h.size != first.size || h.prefix != first.prefix) return std::nullopt;
    if (r > 0 && h.rank <= ranks[r - 1].rank) return std::nullopt;
  }
  std::vector<int> exclude;
  for (int old = 0; old < first.size; ++old) {
    if (std::none_of(ranks.begin(), ranks.end(), [&](const Held& h) { return h.rank == old; })) exclude.push_back(old);
  }
  if (exclude.empty()) return std::nullopt;
  return exclude;
}

}  // namespace

// Three of a world of four survive in order (rank 2 was lost): they shrink, leaving out 2, with
// no unique id; every parent is aborted afterwards, and rank 0 leaves no key behind.
TEST(NcclShrink, SurvivorsInTheirOrderShrinkTheLastCommunicatorLeavingOutTheLostRank) {
  const std::string p = "round/1/nccl/world";
  const auto result = joinRound({{0, 4, p}, {1, 4, p}, {3, 4, p}});
  ASSERT_TRUE(result.errors.empty()) << result.errors.front();
  EXPECT_EQ(result.shrinks[0], 3);
  EXPECT_EQ(result.shrinks[1], 0) << "no ncclCommInitRank";
  ASSERT_EQ(result.excluded.size(), 3U);
  for (const auto& e : result.excluded) EXPECT_EQ(e, std::vector<int>{2});
  EXPECT_EQ(result.parentsAborted, 3);
  EXPECT_FALSE(result.keysLeft);
}

// The first round (nothing announced) never shrinks, even where rank 0 holds a parent.
TEST(NcclShrink, WithoutTheAnnouncementsOfALaterRoundRankZeroDrawsAUniqueId) {
  const std::string p = "round/1/nccl/world";
  const auto result = joinRound({{0, 2, p}}, false);
  ASSERT_TRUE(result.errors.empty()) << result.errors.front();
  EXPECT_EQ(result.shrinks[0], 0);
  EXPECT_EQ(result.shrinks[1], 1);
  EXPECT_EQ(result.parentsAborted, 1);
}

// Generated rounds: an old world of 1-6 ranks, a subset kept, sometimes in another order,
// sometimes a new process or a parent of another round among them. Each must shrink exactly
// where the reference says, leaving out what it says, and otherwise initialise every rank from
// one id; parents aborted, keys gone, no error.
TEST(NcclShrink, GeneratedRoundsShrinkExactlyWhereEveryRankHoldsTheSameCommunicatorInOrder) {
  // NCCL_SHRINK_SEED=<seed> replays a failure's series.
  const char* given = std::getenv("NCCL_SHRINK_SEED");
  const auto seed = given != nullptr ? static_cast<std::uint32_t>(std::stoul(given))
                                     : static_cast<std::uint32_t>(std::random_device{}());
  SCOPED_TRACE("seed " + std::to_string(seed) + " (NCCL_SHRINK_SEED=" + std::to_string(seed) + " replays it)");
  std::mt19937 gen(seed);
  int shrunk = 0;
  for (int trial = 0; trial < 40; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int oldWorld = std::uniform_int_distribution<int>(1, 6)(gen);
    std::vector<Held> ranks;
    for (int old = 0; old < oldWorld; ++old) {
      if (std::bernoulli_distribution(0.7)(gen)) ranks.push_back({old, oldWorld, "round/1/nccl/world"});
    }
    if (ranks.empty() || std::bernoulli_distribution(0.2)(gen)) ranks.push_back({});  // a new process
    if (std::bernoulli_distribution(0.15)(gen)) std::shuffle(ranks.begin(), ranks.end(), gen);
    if (std::bernoulli_distribution(0.1)(gen)) ranks.back().prefix = "round/0/nccl/world";
    const auto want = reference(ranks);
    const auto result = joinRound(ranks);
    ASSERT_TRUE(result.errors.empty()) << result.errors.front();
    const int world = static_cast<int>(ranks.size());
    const int parents = static_cast<int>(std::count_if(ranks.begin(), ranks.end(), [](const Held& h) { return h.rank >= 0; }));
    if (want) {
      ++shrunk;
      EXPECT_EQ(result.shrinks[0], world);
      EXPECT_EQ(result.shrinks[1], 0);
      for (const auto& e : result.excluded) EXPECT_EQ(e, *want);
    } else {
      EXPECT_EQ(result.shrinks[0], 0);
      EXPECT_EQ(result.shrinks[1], world);
    }
    EXPECT_EQ(result.parentsAborted, parents);
    EXPECT_FALSE(result.keysLeft);
  }
  EXPECT_GT(shrunk, 0) << "the generator drew no round that shrinks";
}

// Rank 0 of a world of 1, the survivor of a world of 2, joins the next round holding its revoked
// communicator, which the plan shrinks. What the join threw (null when nothing), and the parent.
namespace {
struct SurvivorJoin {
  std::exception_ptr thrown;
  fd::NcclComm parent;
};
SurvivorJoin joinAsTheSurvivorOfTwo(FakeNcclApi& fake) {
  rdzv::StoreServer server{rdzv::ServerOptions{}};
  const auto parent = fake.newComm();
  fake.commRevoke(parent);
  auto client = rdzv::StoreClient::connect("127.0.0.1", server.port(), {.timeout = kShrinkBound});
  auto held = std::make_unique<fd::NcclParent>(std::shared_ptr<FakeNcclApi>(&fake, [](FakeNcclApi*) {}), parent, 0,
                                               2, 0, "round/1/nccl/world");
  try {
    fd::joinNcclGroup(*client, {.rank = 0, .size = 1, .device = 0, .storePrefix = "round/2/nccl/world"}, fake,
                      fsdp::Deadline::after(kShrinkBound), std::move(held), true);
    return {nullptr, parent};
  } catch (...) {
    return {std::current_exception(), parent};
  }
}
}  // namespace

// A shrink that fails names the call and the rank; the parent is aborted all the same.
TEST(NcclShrink, AShrinkThatFailsNamesTheCallAndTheRank) {
  FakeNcclApi fake;
  fake.setShrinkSupported(true);
  fake.setShrinkFails("invalid usage (fake)");
  const auto join = joinAsTheSurvivorOfTwo(fake);
  try {
    if (join.thrown) std::rethrow_exception(join.thrown);
    FAIL() << "the shrink must fail";
  } catch (const fsdp::Error& e) {
    EXPECT_EQ(std::string(e.what()), "ncclCommShrink on rank 0 of 1 (cuda:0): invalid usage (fake)");
  }
  EXPECT_TRUE(fake.isAborted(join.parent));
}

// A shrink whose NCCL job has not ended by the exchange's deadline (NCCL hands the new
// communicator out only when its job ends): no communicator is used, the parent is aborted
// (which ends the job), and the round fails with a TimeoutError naming the call and the rank.
TEST(NcclShrink, AShrinkStillRunningAtTheDeadlineAbortsTheParentAndTimesOut) {
  FakeNcclApi fake;
  fake.setShrinkSupported(true);
  fake.setShrinkOutlivesTheWait(true);
  const auto join = joinAsTheSurvivorOfTwo(fake);
  try {
    if (join.thrown) std::rethrow_exception(join.thrown);
    FAIL() << "a shrink that never ended must not give a communicator";
  } catch (const fsdp::TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("ncclCommShrink on rank 0 of 1 (cuda:0) did not finish"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(fake.isAborted(join.parent));
  EXPECT_EQ(fake.counts().inits, 0);
}

// The whole path over the fake, round after round: three ranks' communicators aborted by the
// notice (revoked); rank 2 is lost, and ranks 0 and 1 take their parents from their
// communicator objects and shrink them; their barrier runs; then rank 1 is lost and rank 0
// shrinks the shrunk one (its parent's prefix is round 2's). Every communicator closes cleanly.
TEST(NcclShrink, ACommunicatorShrinksRoundAfterRoundAsRanksAreLost) {
  rdzv::StoreServer server{rdzv::ServerOptions{}};
  auto fake = std::make_shared<FakeNcclApi>();
  fake->setShrinkSupported(true);
  fake->setAutoReach(true);
  // One round: each of `world` ranks makes its communicator (from `parents` where given), runs a
  // barrier, and is aborted by the notice.
  const auto round = [&](int n, int world, std::vector<std::unique_ptr<fd::NcclParent>> parents) {
    std::vector<std::unique_ptr<fsdp::worker::Communicator>> comms(static_cast<std::size_t>(world));
    std::vector<std::future<void>> ranks;
    for (int r = 0; r < world; ++r) {
      ranks.push_back(std::async(std::launch::async, [&, r, p = std::move(parents[static_cast<std::size_t>(r)])]() mutable {
        auto client = rdzv::StoreClient::connect("127.0.0.1", server.port(), {.timeout = kShrinkBound});
        auto& comm = comms[static_cast<std::size_t>(r)];
        comm = fd::createNcclCommunicator(*client,
                                          {.rank = r,
                                           .size = world,
                                           .device = 0,
                                           .storePrefix = "round/" + std::to_string(n) + "/nccl/world",
                                           .timeout = kShrinkBound},
                                          fake, fsdp::Deadline::after(kShrinkBound), std::move(p), n > 1);
        comm->barrier().wait();
      }));
    }
    for (auto& f : ranks) f.get();
    for (auto& c : comms) EXPECT_TRUE(c->abort("a rank failed (test)"));
    return comms;
  };
  auto first = round(1, 3, std::vector<std::unique_ptr<fd::NcclParent>>(3));
  std::vector<std::unique_ptr<fd::NcclParent>> held;
  for (int r = 0; r < 2; ++r) held.push_back(fd::takeNcclParent(*first[static_cast<std::size_t>(r)]));
  ASSERT_NE(held[0], nullptr);
  ASSERT_NE(held[1], nullptr);
  EXPECT_EQ(fd::takeNcclParent(*first[0]), nullptr) << "handed over once";
  first.clear();  // rank 2's revoked communicator is aborted with its object
  auto second = round(2, 2, std::move(held));
  held.clear();
  held.push_back(fd::takeNcclParent(*second[0]));
  ASSERT_NE(held[0], nullptr);
  EXPECT_EQ(held[0]->storePrefix, "round/2/nccl/world");
  second.clear();
  auto third = round(3, 1, std::move(held));
  third.clear();
  const auto c = fake->counts();
  EXPECT_EQ(c.inits, 3) << "the first round's three only";
  EXPECT_EQ(c.shrinks, 3);
  const auto log = fake->shrinks();
  ASSERT_EQ(log.size(), 3U);
  EXPECT_EQ(log[0].second, std::vector<int>{2});
  EXPECT_EQ(log[1].second, std::vector<int>{2});
  EXPECT_EQ(log[2].second, std::vector<int>{1});
  EXPECT_EQ(c.collectives, 6) << "a barrier per rank and round";
  EXPECT_EQ(c.revokes, 6);
  EXPECT_EQ(c.aborts, 6) << "every revoked communicator aborted once, shrunk or not";
  EXPECT_EQ(c.callsAfterAbort, 0);
}

// NCCL 2.28.9's non-blocking ncclCommShrink returns ncclSuccess while the job that writes the new
// communicator still runs; only the parent's asynchronous error says when it ended. On an H200 the
// real call read the still-null child at once, freed the pointer NCCL then wrote through, and the
// survivors died of a corrupt heap (scripts/gpu-reform, 2026-11-30). awaitChild (what the real call
// uses) polls the parent whatever the call returned and reads the child only after.
TEST(NcclShrink, AChildIsReadOnlyAfterTheParentSaysItsJobEndedWhateverTheCallReturned) {
  auto fake = std::make_shared<FakeNcclApi>();
  const auto parent = fake->newComm();
  const auto written = fake->newComm();  // what the job writes when it ends
  // The job's end: the pointer is written before the parent stops answering "in progress".
  const auto child = [&] { return fake->asyncPollsLeft(parent) == 0 ? written : nullptr; };
  for (const auto& called : {fd::ApiResult::done(), fd::ApiResult::pending()}) {
    fake->setAsyncPendingPolls(parent, 3);
    const auto made =
        fd::awaitChild(*fake, "ncclCommShrink", parent, called, child, fsdp::Deadline::after(kShrinkBound));
    EXPECT_TRUE(made.result.isDone()) << made.result.cause;
    EXPECT_EQ(made.handle, written);
    EXPECT_EQ(fake->asyncPollsLeft(parent), 0);
  }
  // A job still running at the deadline: pending, and the pointer not read (the job owns it).
  fake->setAsyncPendingPolls(parent, -1);
  bool read = false;
  const auto reading = [&] {
    read = true;
    return written;
  };
  const auto unread =
      fd::awaitChild(*fake, "ncclCommShrink", parent, fd::ApiResult::done(), reading, fsdp::Deadline::after(50ms));
  EXPECT_TRUE(unread.result.isPending());
  EXPECT_EQ(unread.handle, nullptr);
  EXPECT_FALSE(read);
  // A job that ended with no communicator is a failure naming the call; a call that failed
  // started no job: nothing is polled.
  fake->setAsyncPendingPolls(parent, 0);
  const auto nothing = [] { return fd::NcclComm{}; };
  const auto bound = fsdp::Deadline::after(kShrinkBound);
  const auto none = fd::awaitChild(*fake, "ncclCommShrink", parent, fd::ApiResult::done(), nothing, bound);
  EXPECT_TRUE(none.result.isFailed());
  EXPECT_NE(none.result.cause.find("ncclCommShrink"), std::string::npos) << none.result.cause;
  fake->setAsyncPendingPolls(parent, 2);
  const auto refused = fd::awaitChild(*fake, "ncclCommShrink", parent, fd::ApiResult::failed("invalid argument"),
                                      child, fsdp::Deadline::after(kShrinkBound));
  EXPECT_TRUE(refused.result.isFailed());
  EXPECT_EQ(refused.result.cause, "invalid argument");
  EXPECT_EQ(fake->asyncPollsLeft(parent), 2);
}
