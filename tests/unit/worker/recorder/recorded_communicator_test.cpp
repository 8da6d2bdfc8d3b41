// The flight recorder's communicator wrapper over fake backends of each kind: one that runs an
// operation when issued (shared memory), one that queues (Gloo), one whose work is on a device
// (NCCL): issued, started and completed as each backend really does them.
#include <gtest/gtest.h>

#include <ATen/Functions.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include "comm/recorded_communicator.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/worker/flight_recorder.hpp"

namespace {

using namespace fsdp::worker;
using fsdp::flight::Op;
using fsdp::flight::Record;
using fsdp::flight::SlotState;
using namespace std::chrono_literals;

// Every operation returns what `next` makes of it.
class FakeCommunicator final : public Communicator {
 public:
  std::function<Work()> next = [] { return completedWork([] {}); };
  int rank() const override { return 1; }
  int size() const override { return 3; }
  c10::DeviceType deviceType() const override { return c10::DeviceType::CPU; }
  const char* backendName() const override { return "fake"; }
  Work allReduce(at::Tensor, ReduceOp) override { return next(); }
  Work allGather(at::Tensor, at::Tensor) override { return next(); }
  Work reduceScatter(at::Tensor, at::Tensor, ReduceOp) override { return next(); }
  Work broadcast(at::Tensor, int) override { return next(); }
  Work barrier() override { return next(); }
};

// The records of `group`, oldest first.
std::vector<Record> recordsOf(const std::string& group) {
  std::vector<Record> out;
  for (auto& r : fsdp::worker::detail::FlightRecorder::process().read(4096).records) {
    if (r.group == group) out.push_back(std::move(r));
  }
  return out;
}

// Waits (bounded) until `pred` holds over the group's records: the watcher thread writes them.
bool eventually(const std::string& group, const std::function<bool(const std::vector<Record>&)>& pred) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred(recordsOf(group))) return true;
    std::this_thread::yield();
  }
  return false;
}

TEST(RecordedCommunicator, AnOperationDoneWhenIssuedIsRecordedCompleteWithItsTagAndSequence) {
  auto fake = std::make_unique<FakeCommunicator>();
  auto comm = fsdp::worker::detail::recordCollectives(std::move(fake), "test.sync");
  {
    CommTag outer("trainer", "metrics");
    comm->allReduce(at::ones({10}), ReduceOp::kSum).wait();
    {
      CommTag inner("backward", "blocks.3");
      comm->allGather(at::ones({2}), at::empty({6})).wait();
    }
    comm->barrier().wait();
  }
  const auto r = recordsOf("test.sync");
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].seq, 1u);
  EXPECT_EQ(r[0].op, Op::kAllReduce);
  EXPECT_EQ(r[0].count, 10);
  EXPECT_EQ(r[0].dtype, "Float");
  EXPECT_EQ(r[0].tag, "trainer metrics");
  EXPECT_EQ(r[0].groupSize, 3);
  EXPECT_EQ(r[0].groupRank, 1);
  EXPECT_EQ(r[1].tag, "backward blocks.3");
  EXPECT_EQ(r[1].count, 6);  // all_gather: the output's elements, the same on every rank
  EXPECT_EQ(r[2].tag, "trainer metrics");
  EXPECT_EQ(r[2].op, Op::kBarrier);
  for (const auto& rec : r) {
    EXPECT_EQ(rec.state, SlotState::kCompleted);
    EXPECT_EQ(rec.startedNs, rec.issuedNs);
    EXPECT_GE(rec.completedNs, rec.startedNs);
  }
}

TEST(RecordedCommunicator, QueuedOperationsStartWhenTheOneBeforeCompletesWhetherOrNotAnyoneWaits) {
  auto fake = std::make_unique<FakeCommunicator>();
  std::promise<void> first, second;
  int calls = 0;
  fake->next = [&] { return Work((calls++ == 0 ? first : second).get_future().share()); };
  auto comm = fsdp::worker::detail::recordCollectives(std::move(fake), "test.queue");
  comm->allReduce(at::ones({1}), ReduceOp::kSum);
  comm->broadcast(at::ones({4}), 0);
  auto r = recordsOf("test.queue");
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].state, SlotState::kIssued);
  EXPECT_EQ(r[1].startedNs, 0);  // queued behind the first
  first.set_value();
  ASSERT_TRUE(eventually("test.queue", [](const auto& v) {
    return v[0].state == SlotState::kCompleted && v[1].startedNs != 0;
  }));
  r = recordsOf("test.queue");
  EXPECT_GE(r[1].startedNs, r[0].completedNs);
  EXPECT_EQ(r[1].state, SlotState::kIssued);
  second.set_exception(std::make_exception_ptr(fsdp::Error("peer gone")));
  EXPECT_TRUE(eventually("test.queue", [](const auto& v) { return v[1].state == SlotState::kFailed; }));
}

TEST(RecordedCommunicator, DeviceWorkCompletesWhenReadyNotWhenTheStreamIsOrdered) {
  auto fake = std::make_unique<FakeCommunicator>();
  auto done = std::make_shared<std::atomic<bool>>(false);
  fake->next = [done] { return Work([] {}, [done] { return done->load(); }); };
  auto comm = fsdp::worker::detail::recordCollectives(std::move(fake), "test.device");
  Work work = comm->reduceScatter(at::ones({9}), at::empty({3}), ReduceOp::kAverage);
  work.wait();  // orders the stream only
  EXPECT_FALSE(work.ready());
  EXPECT_EQ(recordsOf("test.device").at(0).state, SlotState::kIssued);
  done->store(true);
  EXPECT_TRUE(eventually("test.device", [](const auto& v) { return v[0].state == SlotState::kCompleted; }));
}

TEST(RecordedCommunicator, AnOperationThatThrowsWhenIssuedIsRecordedFailed) {
  auto fake = std::make_unique<FakeCommunicator>();
  fake->next = []() -> Work { throw fsdp::Error("allReduce: dtype mismatch"); };
  auto comm = fsdp::worker::detail::recordCollectives(std::move(fake), "test.throw");
  EXPECT_THROW(comm->allReduce(at::ones({1}), ReduceOp::kSum), fsdp::Error);
  EXPECT_EQ(recordsOf("test.throw").at(0).state, SlotState::kFailed);
}

TEST(RecordedCommunicator, DestroyedWithQueuedWorkItEndsWithoutWaitingForIt) {
  auto fake = std::make_unique<FakeCommunicator>();
  auto never = std::make_shared<std::promise<void>>();
  fake->next = [never] { return Work([] {}, [] { return false; }); };
  auto comm = fsdp::worker::detail::recordCollectives(std::move(fake), "test.teardown");
  comm->allReduce(at::ones({1}), ReduceOp::kSum);
  comm.reset();  // must return: the device work never completes
  EXPECT_EQ(recordsOf("test.teardown").at(0).state, SlotState::kIssued);
}

// What the backend abandoned stays "issued" in its record (above) but leaves the step split's
// in-flight set: a later step is compute, not waiting in a collective that will never end.
TEST(RecordedCommunicator, DestroyedWithQueuedWorkLeavesNothingInFlightForTheStepSplit) {
  auto& recorder = fsdp::worker::detail::FlightRecorder::process();
  if (!recorder.timing()) GTEST_SKIP() << "step timing is off (FSDPRUN_STEP_TIMING=0)";
  auto fake = std::make_unique<FakeCommunicator>();
  fake->next = [] { return Work([] {}, [] { return false; }); };
  auto comm = fsdp::worker::detail::recordCollectives(std::move(fake), "test.abandon");
  comm->allReduce(at::ones({1}), ReduceOp::kSum);
  comm.reset();
  markProgress(700);
  const auto until = fsdp::flight::nowNs() + 5'000'000;
  while (fsdp::flight::nowNs() < until) {
  }
  markProgress(701);
  const auto t = recorder.read(0).timing;
  EXPECT_GE(t.lastStepNs, 5'000'000);
  EXPECT_EQ(t.lastWaitNs, 0);
  EXPECT_EQ(t.lastComputeNs(), t.lastStepNs);
}

}  // namespace
