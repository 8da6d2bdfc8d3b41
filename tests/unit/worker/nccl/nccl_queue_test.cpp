// The NCCL communicator's queue over a fake CUDA/NCCL (fake_nccl_api.hpp): which stream each
// wait, abort and release is ordered against; that a hanging enqueue holds no lock others need;
// failures of the completion event's record; the close after an error; the event pool. No GPU,
// no sleeps: every wait is on a condition, bounded far above what it needs.
#include "comm/nccl/nccl_queue.hpp"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <future>
#include <stdexcept>
#include <thread>

#include "fake_nccl_api.hpp"
#include "fsdp/common/error.hpp"

namespace {

using namespace std::chrono_literals;
namespace fd = fsdp::worker::detail;
using fsdp::testing::FakeNcclApi;

// A bound for waits that take milliseconds when the code is right.
constexpr auto kBound = 30s;

const auto kStreamA = FakeNcclApi::handle(100);
const auto kStreamB = FakeNcclApi::handle(200);
const auto kWatchdogStream = FakeNcclApi::handle(FakeNcclApi::kDefaultStream);

struct Rig {
  explicit Rig(std::chrono::milliseconds timeout = 60s,
               std::shared_ptr<FakeNcclApi> shared = std::make_shared<FakeNcclApi>())
      : fake(std::move(shared)),
        comm(fake->newComm()),
        stream(fake->createStream().handle),
        queue(std::make_unique<fd::NcclQueue>(fake, comm, stream,
                                              fd::NcclQueueOptions{0, 2, 0, timeout})) {}

  fsdp::worker::Work launch(std::vector<at::Tensor> tensors = {},
                            fd::WaitMode mode = fd::WaitMode::kStream,
                            const std::string& op = "allReduce") {
    return queue->launch(op, std::move(tensors), issue(), mode);
  }
  fd::NcclQueue::Issue issue() {
    return [f = fake](fd::NcclComm c, fd::CudaStream s) {
      return f->allReduce(nullptr, nullptr, 1, at::kFloat, fsdp::worker::ReduceOp::kSum, c, s);
    };
  }

  std::shared_ptr<FakeNcclApi> fake;
  fd::NcclComm comm;
  fd::CudaStream stream;
  std::unique_ptr<fd::NcclQueue> queue;
};

// Runs `fn` on a thread whose current stream is `stream`.
template <typename F>
auto onThreadWithStream(fd::CudaStream stream, F fn) {
  return std::async(std::launch::async, [stream, fn] {
    FakeNcclApi::setCurrentStream(stream);
    return fn();
  });
}

int waitsOn(const FakeNcclApi& fake, fd::CudaStream stream) {
  int n = 0;
  for (const auto& [s, e] : fake.streamWaits()) n += s == stream;
  return n;
}

TEST(NcclQueue, WaitOrdersTheStreamCurrentAtLaunchNotTheWaitingThreads) {
  Rig rig;
  auto work = onThreadWithStream(kStreamA, [&] { return rig.launch({at::ones({4})}); }).get();
  const auto done = rig.fake->lastCommEvent();
  FakeNcclApi::setCurrentStream(kStreamB);  // this thread computes elsewhere
  work.wait();
  FakeNcclApi::setCurrentStream(kWatchdogStream);
  const auto waits = rig.fake->streamWaits();
  ASSERT_FALSE(waits.empty());
  EXPECT_EQ(waits.back(), std::make_pair(kStreamA, done)) << "wait() orders the launch's stream";
  EXPECT_EQ(waitsOn(*rig.fake, kStreamB), 0);
  rig.fake->reachAll();
}

TEST(NcclQueue, AnAbortOrdersEachOperationsLaunchStreamBeforeReleasingItsTensors) {
  Rig rig;
  auto a = at::ones({4});
  auto b = at::ones({4});
  std::vector<std::string> problems;
  rig.fake->onStreamWait([&](fd::CudaStream s, fd::CudaEvent) {
    // Only the watchdog waits here (the launches' own waits are on the communication stream).
    if (s == rig.stream) return;
    if (s != kStreamA && s != kStreamB) problems.push_back("a wait on a stream no launch used");
    if ((s == kStreamA ? a : b).use_count() < 2) problems.push_back("tensors released first");
  });
  auto workA = onThreadWithStream(kStreamA, [&] { return rig.launch({a}); }).get();
  auto workB = onThreadWithStream(kStreamB, [&] { return rig.launch({b}); }).get();
  rig.fake->setAsyncError(rig.comm, "remote process exited (fake)");
  ASSERT_TRUE(rig.fake->waitForAborts(1, kBound));
  try {
    workA.wait();
    FAIL() << "wait() after the abort must throw";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("remote process exited (fake)"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 0 of 2 (cuda:0)"), std::string::npos) << e.what();
  }
  rig.queue.reset();  // joins the watchdog: whatever it released is gone
  EXPECT_TRUE(problems.empty()) << problems.front();
  EXPECT_EQ(waitsOn(*rig.fake, kStreamA), 1);
  EXPECT_EQ(waitsOn(*rig.fake, kStreamB), 1);
  EXPECT_EQ(waitsOn(*rig.fake, kWatchdogStream), 0) << "the watchdog thread's stream is no one's";
  EXPECT_EQ(a.use_count(), 1) << "released after the abort, though workA still lives";
  EXPECT_EQ(b.use_count(), 1);
  EXPECT_EQ(rig.fake->counts().aborts, 1);
  EXPECT_EQ(rig.fake->counts().callsAfterAbort, 0);
}

TEST(NcclQueue, AHangingEnqueueHoldsUpNeitherTheWatchdogNorWaitNorTheDevicesOtherCommunicators) {
  Rig rig;
  Rig other(60s, rig.fake);  // a second communicator of the same device
  // A barrier-like operation whose wait() blocks until the watchdog retired it.
  auto first = rig.launch({}, fd::WaitMode::kHost, "first");
  rig.fake->hangEnqueues(rig.comm);
  auto hanging = std::async(std::launch::async,
                            [&] { return rig.launch({}, fd::WaitMode::kStream, "hanging"); });
  // However the test ends, the hanging enqueue settles before `hanging` is waited for.
  struct Release {
    FakeNcclApi& fake;
    ~Release() { fake.releaseEnqueues(); }
  } release{*rig.fake};
  ASSERT_TRUE(rig.fake->waitForEnqueuePolled(kBound));

  rig.fake->reachAll();  // `first` is done: the watchdog retires it, wait() returns
  auto waited = std::async(std::launch::async, [&] { first.wait(); });
  EXPECT_EQ(waited.wait_for(kBound), std::future_status::ready)
      << "wait() and the watchdog were blocked by another operation's enqueue";
  auto issued = std::async(std::launch::async, [&] { other.launch().wait(); });
  EXPECT_EQ(issued.wait_for(kBound), std::future_status::ready)
      << "the device's other communicator was blocked by this one's enqueue";
  EXPECT_FALSE(hanging.wait_for(0s) == std::future_status::ready);

  rig.fake->releaseEnqueues();  // before `waited` and `issued` go, should they still be blocked
  hanging.get().wait();
  rig.fake->reachAll();
}

TEST(NcclQueue, AnOperationWhoseEventRecordFailedIsNotQueuedAndItsCallerGetsTheError) {
  Rig rig;
  auto t = at::ones({4});
  bool heldAtSync = false;
  rig.fake->onSynchronize([&](fd::CudaStream s) {
    if (s == rig.stream) heldAtSync = t.use_count() >= 2;
  });
  rig.fake->failNextCommRecord("an illegal memory access was encountered (fake)");
  try {
    rig.launch({t}, fd::WaitMode::kStream, "reduceScatter");
    FAIL() << "launch must throw";
  } catch (const fsdp::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("nccl reduceScatter failed on rank 0 of 2 (cuda:0)"), std::string::npos)
        << what;
    EXPECT_NE(what.find("cudaEventRecord"), std::string::npos) << what;
    EXPECT_NE(what.find("an illegal memory access was encountered (fake)"), std::string::npos)
        << what;
  }
  const auto c = rig.fake->counts();
  EXPECT_EQ(c.collectives, 1);
  EXPECT_EQ(c.aborts, 1) << "the collective was queued: only an abort ends it";
  EXPECT_EQ(c.waitsOnUnrecorded, 0) << "a wait on the unrecorded event orders nothing";
  EXPECT_TRUE(heldAtSync) << "the communication stream drains before the tensors go";
  EXPECT_EQ(t.use_count(), 1);
  // Nothing of it was queued: the watchdog never read an event that was not recorded.
  for (int e = 1000; e < 1100; ++e) {
    EXPECT_EQ(rig.fake->queriesOf(FakeNcclApi::handle(e)), 0) << "event " << e;
  }
  EXPECT_THROW(rig.launch(), fsdp::Error) << "later operations are refused";
  rig.queue.reset();
  EXPECT_EQ(rig.fake->counts().aborts, 1);
  EXPECT_EQ(rig.fake->counts().callsAfterAbort, 0);
}

TEST(NcclQueue, DestroyedDuringUnwindingItAbortsAtOnceInsteadOfWaiting) {
  auto fake = std::make_shared<FakeNcclApi>();
  // The operation never finishes and the timeout is a minute: a close that waited would take
  // one (then finalize, another).
  auto closed = std::async(std::launch::async, [fake] {
    try {
      Rig rig(60s, fake);
      auto work = rig.launch({at::ones({4})});
      throw std::runtime_error("an error elsewhere");
    } catch (const std::runtime_error&) {
    }
  });
  const bool prompt = closed.wait_for(kBound) == std::future_status::ready;
  if (!prompt) fake->reachAll();  // let a waiting close end, so that the test reports
  closed.get();
  EXPECT_TRUE(prompt) << "the close waited for an operation in flight during unwinding";
  const auto c = fake->counts();
  EXPECT_EQ(c.aborts, 1);
  EXPECT_EQ(c.finalizes, 0);
  EXPECT_EQ(c.destroys, 0);
  EXPECT_EQ(c.callsAfterAbort, 0);
  EXPECT_EQ(c.streamsDestroyed, 1);
}

TEST(NcclQueue, DestroyedAfterAFailureItNeitherWaitsNorFinalizes) {
  Rig rig;
  auto work = rig.launch({at::ones({4})});
  rig.fake->setAsyncError(rig.comm, "unhandled system error (fake)");
  ASSERT_TRUE(rig.fake->waitForAborts(1, kBound));
  rig.queue.reset();
  const auto c = rig.fake->counts();
  EXPECT_EQ(c.aborts, 1);
  EXPECT_EQ(c.finalizes, 0);
  EXPECT_EQ(c.callsAfterAbort, 0);
  EXPECT_THROW(work.wait(), fsdp::Error);
}

TEST(NcclQueue, DestroyedNormallyItWaitsForItsOperationsThenFinalizes) {
  auto fake = std::make_shared<FakeNcclApi>();
  auto t = at::ones({4});
  fsdp::worker::Work work({}, {});
  {
    Rig rig(60s, fake);
    work = rig.launch({t});
    // The close waits for the operation: it is reached from another thread, before or while the
    // close waits.
    auto reacher = std::async(std::launch::async, [&] { fake->reachAll(); });
    rig.queue.reset();
    reacher.get();
  }
  const auto c = fake->counts();
  EXPECT_EQ(c.aborts, 0);
  EXPECT_EQ(c.finalizes, 1);
  EXPECT_EQ(c.destroys, 1);
  EXPECT_EQ(t.use_count(), 1);
  EXPECT_TRUE(work.ready());
  EXPECT_NO_THROW(work.wait());
}

TEST(NcclQueue, EventsComeFromAPoolNotOnePerOperation) {
  Rig rig;
  rig.fake->setAutoReach(true);
  // One at a time: two events in use (the compute stream's, the completion's), reused.
  for (int i = 0; i < 200; ++i) rig.launch({at::ones({2})}, fd::WaitMode::kHost).wait();
  EXPECT_EQ(rig.fake->counts().eventsCreated, 2) << "not two per operation";
  // Twenty in flight at once, then one the host waits for (they are retired in order): the pool
  // grows to what is in use (21 completion events and the compute stream's), no further.
  std::vector<fsdp::worker::Work> works;
  for (int i = 0; i < 20; ++i) works.push_back(rig.launch());
  rig.launch({}, fd::WaitMode::kHost).wait();
  for (auto& w : works) EXPECT_TRUE(w.ready());
  works.clear();
  for (int i = 0; i < 50; ++i) rig.launch({}, fd::WaitMode::kHost).wait();
  const auto during = rig.fake->counts();
  EXPECT_EQ(during.eventsCreated, 22);
  EXPECT_EQ(during.eventsDestroyed, 0);
  rig.queue.reset();
  const auto after = rig.fake->counts();
  EXPECT_EQ(after.eventsDestroyed, after.eventsCreated) << "the pool destroys every event it made";
}

TEST(NcclQueue, AnOperationPastItsDeadlineAbortsTheCommunicatorAndLaterOnesAreRefused) {
  Rig rig(50ms);
  auto work = rig.launch({}, fd::WaitMode::kStream, "allGather");
  ASSERT_TRUE(rig.fake->waitForAborts(1, kBound));
  try {
    work.wait();
    FAIL() << "wait() must throw";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("nccl allGather failed on rank 0 of 2 (cuda:0): did not "
                                         "finish within its timeout of 50 ms"),
              std::string::npos)
        << e.what();
  }
  try {
    rig.launch({}, fd::WaitMode::kStream, "broadcast");
    FAIL() << "a later launch must throw";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("; broadcast was not run"), std::string::npos) << e.what();
  }
}

}  // namespace

// Communicator::abort (an in-process re-formation): an operation in flight wakes its waiter
// with CommAborted, later launches are refused the same way, the stream is synchronised, and a
// new communicator (the next round's) steps again.
TEST(NcclQueue, AnAbortWakesTheWaiterWithCommAbortedAndTheNextCommunicatorStepsAgain) {
  auto fake = std::make_shared<FakeNcclApi>();
  Rig rig(60s, fake);
  int synchronized = 0;
  fake->onSynchronize([&](fd::CudaStream s) { synchronized += s == rig.stream; });
  auto work = rig.launch({at::ones({4})}, fd::WaitMode::kHost);  // never reached: in flight
  auto waiter = std::async(std::launch::async, [&] { return fsdp::testing::waitOutcome(work); });
  EXPECT_TRUE(rig.queue->abort("rank 1 failed (test)"));
  ASSERT_EQ(waiter.wait_for(kBound), std::future_status::ready);
  EXPECT_EQ(waiter.get(), "CommAborted");
  EXPECT_EQ(fake->counts().aborts, 1);
  EXPECT_GE(synchronized, 1) << "the communication stream is synchronised after the abort";
  try {
    rig.launch({at::ones({4})});
    FAIL() << "a launch after the abort must throw";
  } catch (const fsdp::CommAborted& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 failed (test)"), std::string::npos) << e.what();
  }
  rig.queue.reset();
  EXPECT_EQ(fake->counts().callsAfterAbort, 0);

  Rig next(60s, fake);
  fake->setAutoReach(true);
  auto again = next.launch({at::ones({4})}, fd::WaitMode::kHost);
  EXPECT_NO_THROW(again.wait());
  next.queue.reset();
}
