// The flight recorder ring: what one process writes another reads back, whatever state the
// writer left it in (wrapped, torn, overwritten).
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "fsdp/common/flight_ring.hpp"

namespace {

using namespace fsdp::flight;

Writer::Issue allReduce(std::uint64_t seq, std::string_view tag = "trainer metrics") {
  return {.group = "world", .groupSize = 3, .groupRank = 1, .seq = seq, .op = Op::kAllReduce, .count = 10,
          .dtype = "Float", .tag = tag};
}

TEST(FlightRing, AReaderInAnotherMappingSeesWhatTheWriterRecorded) {
  RingMemory agent = RingMemory::create(8);
  std::string why;
  auto worker = RingMemory::attach(::fcntl(agent.fd(), F_DUPFD_CLOEXEC, 3), &why);
  ASSERT_TRUE(worker) << why;
  Writer w(*worker);
  EXPECT_FALSE(agent.read().attached);
  w.attach(1);
  const auto first = w.issue(allReduce(1), true);
  w.complete(first, true);
  w.issue(allReduce(2, "a tag far longer than the forty-seven characters a slot can hold"), false);
  w.markProgress(7, "trainer step");
  const Reading r = agent.read();
  ASSERT_TRUE(r.attached);
  EXPECT_EQ(r.error, "");
  EXPECT_EQ(r.rank, 1);
  EXPECT_EQ(r.pid, ::getpid());
  ASSERT_EQ(r.records.size(), 2u);
  EXPECT_EQ(r.records[0].state, SlotState::kCompleted);
  EXPECT_GT(r.records[0].completedNs, 0);
  EXPECT_EQ(r.records[0].group, "world");
  EXPECT_EQ(r.records[0].tag, "trainer metrics");
  EXPECT_EQ(r.records[1].state, SlotState::kIssued);
  EXPECT_EQ(r.records[1].startedNs, 0);
  EXPECT_EQ(r.records[1].tag.size(), 47u);
  EXPECT_EQ(r.progress.step, 7);
  EXPECT_EQ(r.progress.what, "trainer step");
  EXPECT_EQ(r.lastCompletedNs, r.records[0].completedNs);
}

TEST(FlightRing, AWrappedRingKeepsTheNewestRecordsInOrder) {
  RingMemory ring = RingMemory::create(4);
  Writer w(ring);
  w.attach(0);
  for (std::uint64_t seq = 1; seq <= 10; ++seq) w.complete(w.issue(allReduce(seq), true), true);
  const Reading r = ring.read();
  ASSERT_EQ(r.records.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(r.records[i].seq, 7 + i);
  EXPECT_EQ(ring.read(2).records.front().seq, 9u);
  // Completing a slot that was reused since changes nothing.
  w.complete(0, false);
  EXPECT_EQ(ring.read().records.front().state, SlotState::kCompleted);
}

TEST(FlightRing, TheFirstCompletionWins) {
  RingMemory ring = RingMemory::create(4);
  Writer w(ring);
  const auto i = w.issue(allReduce(1), true);
  w.complete(i, false);
  w.complete(i, true);
  EXPECT_EQ(ring.read().records.at(0).state, SlotState::kFailed);
}

TEST(FlightRing, ASlotBeingWrittenIsLeftOutNotMisread) {
  RingMemory ring = RingMemory::create(4);
  Writer w(ring);
  w.issue(allReduce(1), true);
  w.issue(allReduce(2), true);
  ring.slot(1).generation.store(3);  // the writer stopped halfway through slot 1
  const Reading r = ring.read();
  ASSERT_EQ(r.records.size(), 1u);
  EXPECT_EQ(r.records[0].seq, 1u);
}

TEST(FlightRing, ACorruptHeaderIsReportedAndNothingElseIsRead) {
  RingMemory ring = RingMemory::create(4);
  Writer w(ring);
  w.attach(2);
  w.issue(allReduce(1), true);
  std::memset(static_cast<void*>(&ring.header()), 0xab, 16);  // a wild write in the worker
  const Reading r = ring.read();
  EXPECT_NE(r.error.find("corrupt"), std::string::npos) << r.error;
  EXPECT_TRUE(r.records.empty());
}

TEST(FlightRing, GarbageCountersNeverMakeTheReaderReadOutsideTheRing) {
  RingMemory ring = RingMemory::create(4);
  ring.header().issued.store(~0ull - 2);  // as if the counter were overwritten
  const Reading r = ring.read();
  EXPECT_TRUE(r.records.empty());  // no slot carries a generation that matches
}

TEST(FlightRing, AttachRefusesAnFdThatIsNoRing) {
  const int fd = ::memfd_create("not-a-ring", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  std::string why;
  EXPECT_FALSE(RingMemory::attach(fd, &why));
  EXPECT_NE(why.find("not the agent's flight recorder"), std::string::npos) << why;
  EXPECT_NE(::fcntl(fd, F_GETFD), -1);  // not ours: left open
  ::close(fd);
}

TEST(FlightRing, ActivityMarksKeepTheStepAndBusyIsReadBack) {
  RingMemory ring = RingMemory::create(4);
  Writer w(ring);
  w.markProgress(12, "trainer step");
  w.markProgress(-1, "eval batch");
  w.setBusy(true, "checkpoint write");
  auto r = ring.read();
  EXPECT_EQ(r.progress.step, 12);
  EXPECT_EQ(r.progress.what, "eval batch");
  EXPECT_EQ(r.progress.count, 2);
  EXPECT_GT(r.progress.busySinceNs, 0);
  EXPECT_EQ(r.progress.busyWhat, "checkpoint write");  // 16 characters at most
  w.setBusy(false);
  w.setBusy(true, "checkpoint write and more");
  EXPECT_EQ(ring.read().progress.busyWhat, "checkpoint write");
  w.setBusy(false);
  EXPECT_EQ(ring.read().progress.busySinceNs, 0);
  EXPECT_EQ(ring.read().progress.busyWhat, "");
  w.setBusy(true);
  EXPECT_EQ(ring.read().progress.busyWhat, "long operation");
}

TEST(FlightRing, GroupsOfMoreThan255RanksKeepTheirRanks) {
  RingMemory ring = RingMemory::create(4);
  Writer w(ring);
  w.issue({.group = "world", .groupSize = 4096, .groupRank = 3000, .seq = 1, .op = Op::kBarrier}, true);
  const auto r = ring.read().records.at(0);
  EXPECT_EQ(r.groupSize, 4096);
  EXPECT_EQ(r.groupRank, 3000);
}

TEST(FlightRing, ProgressMarksKeepTheLongestGap) {
  RingMemory ring = RingMemory::create(4);
  Writer w(ring);
  w.markProgress(1, "step");
  ring.header().progressNs.store(nowNs() - 2'000'000'000);  // the last mark was 2 s ago
  w.markProgress(2, "step");
  const Reading r = ring.read();
  EXPECT_EQ(r.progress.count, 2);
  EXPECT_GE(r.progress.longestGapNs, 2'000'000'000);
}

}  // namespace
