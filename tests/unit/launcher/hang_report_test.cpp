// The hang analysis over hand-made and generated flight records: who waits, who never came, a
// desync, ranks without records; and the views' JSON as agents exchange it.
#include <gtest/gtest.h>

#include <random>

#include "fsdp/common/error.hpp"
#include "hang/report.hpp"

namespace {

using namespace fsdp::launcher::detail;
using fsdp::flight::Op;
using fsdp::flight::Record;
using fsdp::flight::SlotState;

constexpr std::int64_t kNow = 1'000'000'000'000;

Record rec(std::uint64_t seq, Op op, std::int64_t count, bool done, int groupRank, int size = 3,
           std::string group = "world") {
  Record r;
  r.index = seq;
  r.seq = seq;
  r.group = std::move(group);
  r.groupSize = size;
  r.groupRank = groupRank;
  r.op = op;
  r.count = count;
  r.dtype = "Float";
  r.tag = "backward blocks.0";
  r.issuedNs = kNow - 6'000'000'000 + static_cast<std::int64_t>(seq);
  r.startedNs = r.issuedNs;
  r.completedNs = done ? r.issuedNs + 1000 : 0;
  r.state = done ? SlotState::kCompleted : SlotState::kIssued;
  return r;
}

RankView view(int rank, std::vector<Record> records) {
  RankView v;
  v.rank = rank;
  v.host = "node" + std::to_string(rank);
  v.pid = 100 + rank;
  v.ringAttached = true;
  v.progress = {6, 6, kNow - 5'000'000'000, 100'000'000, "trainer step"};
  v.records = std::move(records);
  return v;
}

std::string joined(const HangAnalysis& a) {
  std::string out;
  for (const auto& l : a.lines) out += l + "\n";
  return out;
}

TEST(HangAnalysis, NamesTheRankThatNeverEnteredTheCollectiveOthersWaitIn) {
  const std::vector<RankView> views = {
      view(0, {rec(44, Op::kReduceScatter, 9, true, 0), rec(45, Op::kAllGather, 9, false, 0)}),
      view(1, {rec(44, Op::kReduceScatter, 9, true, 1)}),
      view(2, {rec(44, Op::kReduceScatter, 9, true, 2), rec(45, Op::kAllGather, 9, false, 2)})};
  const auto a = analyzeHang(views, 3, kNow);
  EXPECT_EQ(a.lagging, std::set<int>{1}) << joined(a);
  EXPECT_FALSE(a.desync);
  const auto text = joined(a);
  EXPECT_NE(text.find("ranks 0, 2 wait in world #45 all_gather of 9 Float (backward blocks.0) for 6.0 s"),
            std::string::npos) << text;
  EXPECT_NE(text.find("rank 1 never entered world #45: its last collective was world #44 reduce_scatter"),
            std::string::npos) << text;
  EXPECT_NE(text.find("last progress mark: trainer step 6, 5.0 s ago"), std::string::npos) << text;
}

Record wait(std::uint64_t seq, std::int64_t step, bool done, int rank, int size = 3) {
  Record r = rec(seq, Op::kWait, step, done, rank, size, "checkpoint");
  r.dtype = "";
  r.tag = "save step " + std::to_string(step) + ": waiting for ranks' files";
  return r;
}

// The shape of a save: rank 0 waits in the save's commit for every rank's files, rank 2 arrived
// (its record completed at once) and waits in the next step's all-gather, rank 1 stalled in its
// own code before the save. Rank 1 is named in both groups, and nobody else is blamed.
TEST(HangAnalysis, ARankThatNeverEnteredASaveOthersWaitInIsNamed) {
  const std::vector<RankView> views = {
      view(0, {rec(40, Op::kAllGather, 9, true, 0), wait(1, 3, true, 0), rec(41, Op::kAllGather, 9, true, 0),
               wait(2, 6, false, 0)}),
      view(1, {rec(40, Op::kAllGather, 9, true, 1), wait(1, 3, true, 1), rec(41, Op::kAllGather, 9, true, 1)}),
      view(2, {rec(40, Op::kAllGather, 9, true, 2), wait(1, 3, true, 2), rec(41, Op::kAllGather, 9, true, 2),
               wait(2, 6, true, 2), rec(42, Op::kAllGather, 9, false, 2)})};
  const auto a = analyzeHang(views, 3, kNow);
  const auto text = joined(a);
  EXPECT_EQ(a.lagging, std::set<int>{1}) << text;
  EXPECT_FALSE(a.desync) << text;
  EXPECT_NE(text.find("rank 0 waits in checkpoint #2 (save step 6: waiting for ranks' files) for 6.0 s"),
            std::string::npos) << text;
  EXPECT_NE(text.find("rank 1 never entered checkpoint #2: its last collective was checkpoint #1 (save step 3"),
            std::string::npos) << text;
  EXPECT_NE(text.find("rank 2 waits in world #42"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 1 never entered world #42"), std::string::npos) << text;
}

// The first save: the stalled rank has no record of the group at all.
TEST(HangAnalysis, ARankThatNeverEnteredTheFirstSaveIsNamed) {
  const std::vector<RankView> views = {view(0, {wait(1, 3, false, 0)}), view(1, {}),
                                       view(2, {wait(1, 3, true, 2)})};
  const auto a = analyzeHang(views, 3, kNow);
  EXPECT_EQ(a.lagging, std::set<int>{1}) << joined(a);
  EXPECT_NE(joined(a).find("rank 1 never entered checkpoint #1: it has issued nothing in checkpoint; last progress "
                           "mark: trainer step 6"),
            std::string::npos) << joined(a);
}

// Two ranks saving different steps at the same point of the group is a desync.
TEST(HangAnalysis, SavesOfDifferentStepsAtOneSequenceNumberAreADesync) {
  const std::vector<RankView> views = {view(0, {wait(1, 6, false, 0)}), view(1, {wait(1, 7, true, 1)}),
                                       view(2, {wait(1, 6, true, 2)})};
  const auto a = analyzeHang(views, 3, kNow);
  EXPECT_TRUE(a.desync);
  EXPECT_NE(joined(a).find("desync in checkpoint #1: ranks 0, 2 issued wait at step 6; rank 1 issued wait at step 7"),
            std::string::npos) << joined(a);
}

TEST(HangAnalysis, ARankInsideItsOwnLongOperationIsSaidWithHowLong) {
  auto busy = view(1, {rec(44, Op::kAllGather, 9, true, 1)});
  busy.progress.busySinceNs = kNow - 52'000'000'000;
  busy.progress.busyWhat = "checkpoint write";
  auto restoring = view(2, {rec(44, Op::kAllGather, 9, true, 2), rec(45, Op::kAllGather, 9, false, 2)});
  restoring.progress = {1, -1, kNow - 5'000'000'000, 0, "snapshot restore"};
  const auto a = analyzeHang({view(0, {rec(44, Op::kAllGather, 9, true, 0), rec(45, Op::kAllGather, 9, false, 0)}),
                              busy, restoring},
                             3, kNow);
  EXPECT_EQ(a.lagging, std::set<int>{1}) << joined(a);
  EXPECT_NE(joined(a).find("rank 1 is inside its own checkpoint write (waiting for no other rank), for 52.0 s"),
            std::string::npos) << joined(a);
  const auto back = rankViewsFromJson(rankViewsToJson({busy, restoring}));
  EXPECT_EQ(back.at(0).progress.busySinceNs, busy.progress.busySinceNs);
  EXPECT_EQ(back.at(0).progress.busyWhat, "checkpoint write");
  // A mark without a step shows none.
  RankView silent = view(1, {});
  silent.progress = {1, -1, kNow - 5'000'000'000, 0, "checkpoint load"};
  const auto b = analyzeHang({view(0, {wait(1, 0, false, 0, 2)}), silent}, 2, kNow);
  EXPECT_NE(joined(b).find("last progress mark: checkpoint load, 5.0 s ago"), std::string::npos) << joined(b);
}

TEST(HangAnalysis, ASkippedCollectiveIsADesyncNamingBothOperations) {
  const std::vector<RankView> views = {
      view(0, {rec(4, Op::kAllReduce, 1, true, 0), rec(5, Op::kAllReduce, 1, false, 0)}),
      view(1, {rec(4, Op::kAllReduce, 1, true, 1), rec(5, Op::kAllGather, 30, false, 1)}),
      view(2, {rec(4, Op::kAllReduce, 1, true, 2), rec(5, Op::kAllReduce, 1, false, 2)})};
  const auto a = analyzeHang(views, 3, kNow);
  EXPECT_TRUE(a.desync);
  EXPECT_EQ(a.lagging, std::set<int>{1}) << joined(a);
  EXPECT_NE(joined(a).find("desync in world #5: rank 1 issued all_gather of 30 Float; ranks 0, 2 issued all_reduce of 1 Float"),
            std::string::npos) << joined(a);
}

// HYBRID_SHARD, 2 nodes x 2 ranks: rank 3 spins. Rank 2 waits in its shard group for it, and so
// is behind in replicate/0, where rank 0 waits for rank 2: only rank 3 is the cause.
TEST(HangAnalysis, ARankWaitingInOneGroupIsNotBlamedForBeingBehindInAnother) {
  const auto r = [](const char* group, std::uint64_t seq, bool done, int groupRank) {
    return rec(seq, Op::kAllGather, 8, done, groupRank, 2, group);
  };
  const std::vector<RankView> views = {
      view(0, {r("shard/0", 6, true, 0), r("replicate/0", 5, true, 0), r("replicate/0", 6, false, 0)}),
      view(1, {r("shard/0", 6, true, 1), r("replicate/1", 5, true, 0), r("replicate/1", 6, false, 0)}),
      view(2, {r("shard/1", 5, true, 0), r("replicate/0", 5, true, 1), r("shard/1", 6, false, 0)}),
      view(3, {r("shard/1", 5, true, 1), r("replicate/1", 5, true, 1)})};
  const auto a = analyzeHang(views, 4, kNow);
  EXPECT_EQ(a.lagging, std::set<int>{3}) << joined(a);
  EXPECT_NE(joined(a).find("rank 2 never entered replicate/0 #6"), std::string::npos) << joined(a);
  EXPECT_NE(joined(a).find("it waits in another group itself"), std::string::npos) << joined(a);
}

TEST(HangAnalysis, RanksWithoutRecordsAreNamedAndInspected) {
  RankView script = view(1, {});
  script.ringAttached = false;
  RankView corrupt = view(2, {});
  corrupt.ringError = "the flight recorder ring is corrupt";
  const auto a = analyzeHang({view(0, {rec(1, Op::kBarrier, 0, false, 0)}), script, corrupt}, 4, kNow);
  const auto text = joined(a);
  EXPECT_TRUE(a.lagging.count(1) && a.lagging.count(2)) << text;
  EXPECT_NE(text.find("rank 1: no flight records"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 2: flight records unreadable"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 3: nothing known"), std::string::npos) << text;
}

// A survivor kept for an in-process re-formation that never re-formed: the new round's ranks
// wait for it (the new process inside fsdp::init(), without a ring yet; the survivor that did
// re-form in the round's first collective). It is the one named, not those waiting for it.
TEST(HangAnalysis, ASurvivorThatHasNotJoinedTheRoundIsNamedNotTheRanksWaitingForIt) {
  RankView waiting = view(0, {rec(1, Op::kAllGather, 12, false, 0)});
  RankView starting = view(1, {});
  starting.ringAttached = false;
  RankView stuck = view(2, {});
  stuck.joined = false;
  const auto a = analyzeHang({waiting, starting, stuck}, 3, kNow);
  const auto text = joined(a);
  EXPECT_EQ(a.lagging, std::set<int>{2}) << text;
  EXPECT_NE(text.find("rank 2 has not joined this round"), std::string::npos) << text;
  EXPECT_NE(text.find("last progress mark: trainer step 6"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 1: no flight records yet (a new process of this round"), std::string::npos) << text;
  // The one-line messages (the agent's restart reason) name it too, not rank 1 listed first.
  ASSERT_GE(a.cause, 0) << text;
  EXPECT_EQ(a.lines.at(static_cast<std::size_t>(a.cause)).rfind("rank 2 has not joined this round", 0), 0u) << text;
  // Without such a survivor, a rank without a ring is still one to look at.
  const auto b = analyzeHang({waiting, starting, view(2, {})}, 3, kNow);
  EXPECT_TRUE(b.lagging.count(1)) << joined(b);
  // The agents exchange it.
  EXPECT_FALSE(rankViewsFromJson(rankViewsToJson({stuck})).at(0).joined);
  EXPECT_TRUE(rankViewsFromJson(rankViewsToJson({waiting})).at(0).joined);
}

// A stopped process in a round no rank has issued a collective in yet: nothing in the records,
// yet it is the one to name (not the new process without a ring, waiting for it in init()).
TEST(HangAnalysis, AStoppedRankIsNamedEvenWhereTheRecordsSayNothing) {
  RankView starting = view(1, {});
  starting.ringAttached = false;
  RankView frozen = view(2, {});
  frozen.stopped = true;
  const auto a = analyzeHang({view(0, {}), starting, frozen}, 3, kNow);
  EXPECT_EQ(a.lagging, std::set<int>{2}) << joined(a);
  EXPECT_EQ(a.lines.front().rfind("rank 2 is stopped (SIGSTOP or SIGTSTP)", 0), 0u) << joined(a);
  EXPECT_EQ(a.cause, 0);
  // Stopped inside a collective every rank entered: not the transport.
  RankView inside = view(1, {rec(4, Op::kAllReduce, 1, false, 1, 2)});
  inside.stopped = true;
  const auto b = analyzeHang({view(0, {rec(4, Op::kAllReduce, 1, false, 0, 2)}), inside}, 2, kNow);
  EXPECT_EQ(b.lagging, std::set<int>{1}) << joined(b);
  EXPECT_EQ(joined(b).find("the transport itself is stuck"), std::string::npos) << joined(b);
  EXPECT_TRUE(rankViewsFromJson(rankViewsToJson({frozen})).at(0).stopped);
}

TEST(HangAnalysis, EveryRankOutsideCommunicationMeansStacksOfAll) {
  const auto a = analyzeHang({view(0, {rec(3, Op::kAllReduce, 1, true, 0, 2)}),
                              view(1, {rec(3, Op::kAllReduce, 1, true, 1, 2)})}, 2, kNow);
  EXPECT_EQ(a.lagging, (std::set<int>{0, 1}));
}

// Generated: a world of N ranks runs K collectives; one rank stops after j of them while the
// others enter collective j+1. The analysis must name exactly that rank, whatever N, K, j.
TEST(HangAnalysis, GeneratedStallsNameTheStalledRank) {
  const unsigned seed = std::random_device{}();
  std::mt19937 random(seed);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = std::uniform_int_distribution<int>(2, 9)(random);
    const int stalled = std::uniform_int_distribution<int>(0, n - 1)(random);
    const int j = std::uniform_int_distribution<int>(1, 80)(random);
    std::vector<RankView> views;
    for (int r = 0; r < n; ++r) {
      std::vector<Record> records;
      const int upto = r == stalled ? j : j + 1;
      for (int s = std::max(1, upto - 63); s <= upto; ++s) {
        const Op op = s % 2 ? Op::kAllGather : Op::kReduceScatter;
        records.push_back(rec(static_cast<std::uint64_t>(s), op, 100 + s, s <= j, r, n));
      }
      views.push_back(view(r, std::move(records)));
    }
    const auto a = analyzeHang(views, n, kNow);
    ASSERT_EQ(a.lagging, std::set<int>{stalled}) << "seed " << seed << " trial " << trial << "\n" << joined(a);
    ASSERT_FALSE(a.desync) << "seed " << seed;
  }
}

TEST(RankViews, SurviveTheirJsonAndRefuseGarbage) {
  auto v = view(3, {rec(7, Op::kBroadcast, 5, true, 3, 4, "shard/1")});
  v.state = "stopped (SIGSTOP)";
  v.stack = "thread 1:\n#0 f";
  const auto back = rankViewsFromJson(rankViewsToJson({v}));
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(back[0].rank, 3);
  EXPECT_EQ(back[0].records.at(0).group, "shard/1");
  EXPECT_EQ(back[0].records.at(0).op, Op::kBroadcast);
  EXPECT_EQ(back[0].stack, v.stack);
  EXPECT_EQ(back[0].progress.what, "trainer step");
  EXPECT_THROW(rankViewsFromJson("[{\"rank\": 1}]"), fsdp::ProtocolError);
  EXPECT_THROW(rankViewsFromJson("not json"), fsdp::ProtocolError);
}

TEST(HangReportText, IndentsStacksOfLaggingRanksOnly) {
  auto a = view(0, {});
  auto b = view(1, {});
  b.state = "running";
  b.stack = "thread 101:\n#0 spin";
  HangAnalysis analysis;
  analysis.lagging = {1};
  analysis.lines = {"rank 1 never entered world #2"};
  const auto text = formatHangReport("the job is hung", analysis, {a, b});
  EXPECT_EQ(text, "the job is hung\n  rank 1 never entered world #2\n  rank 1 on node1, pid 101: running\n"
                  "    thread 101:\n    #0 spin\n");
}

}  // namespace
