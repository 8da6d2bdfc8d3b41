// RoundState driven by a fake clock: the rendezvous semantics without sockets.
#include "fsdp/rendezvous/round.hpp"

#include <gtest/gtest.h>

#include "fsdp/common/error.hpp"

namespace fsdp::rendezvous {
namespace {

using namespace std::chrono_literals;

JoinRequest req(const std::string& node, int minNodes, int maxNodes, int local = 1, int preferred = -1) {
  JoinRequest r;
  r.node = node;
  r.address = node + ".addr";
  r.localWorldSize = local;
  r.preferredRank = preferred;
  r.masterPort = 1000;
  r.minNodes = minNodes;
  r.maxNodes = maxNodes;
  r.lastCallTimeout = 500ms;
  r.heartbeatTimeout = 2s;
  r.joinTimeout = 10s;
  return r;
}

std::map<AgentId, Assignment> assigned(const std::vector<Event>& events) {
  std::map<AgentId, Assignment> out;
  for (const auto& e : events) {
    if (e.kind == EventKind::kAssigned) out[e.agent] = e.assignment;
  }
  return out;
}

int count(const std::vector<Event>& events, EventKind kind) {
  return static_cast<int>(std::count_if(events.begin(), events.end(), [kind](const Event& e) { return e.kind == kind; }));
}

TEST(Rounds, CompleteAtMaxNodesAtOnceWithDeterministicRanks) {
  RoundState s;
  const auto t = Clock::now();
  EXPECT_TRUE(s.join(1, req("node-c", 3, 3, 2), t).empty());
  EXPECT_TRUE(s.join(2, req("node-a", 3, 3, 1), t).empty());
  const auto a = assigned(s.join(3, req("node-b", 3, 3, 4), t));
  ASSERT_EQ(a.size(), 3u);
  // Sorted by node name: a, b, c; offsets are prefix sums of local world sizes.
  EXPECT_EQ(a.at(2).nodeRank, 0);
  EXPECT_EQ(a.at(3).nodeRank, 1);
  EXPECT_EQ(a.at(1).nodeRank, 2);
  EXPECT_EQ(a.at(2).rankOffset, 0);
  EXPECT_EQ(a.at(3).rankOffset, 1);
  EXPECT_EQ(a.at(1).rankOffset, 5);
  EXPECT_EQ(a.at(1).worldSize, 7);
  EXPECT_EQ(a.at(1).nnodes, 3);
  EXPECT_EQ(a.at(1).masterAddr, "node-a.addr");
  EXPECT_EQ(a.at(1).round, 0);
}

TEST(Rounds, PreferredRanksComeFirst) {
  RoundState s;
  const auto t = Clock::now();
  s.join(1, req("a", 3, 3, 1, -1), t);
  s.join(2, req("b", 3, 3, 1, 1), t);
  const auto a = assigned(s.join(3, req("c", 3, 3, 1, 0), t));
  EXPECT_EQ(a.at(3).nodeRank, 0);
  EXPECT_EQ(a.at(2).nodeRank, 1);
  EXPECT_EQ(a.at(1).nodeRank, 2);
}

TEST(Rounds, MinNodesCompleteAfterTheLastCallWait) {
  RoundState s;
  const auto t = Clock::now();
  s.join(1, req("a", 2, 4), t);
  EXPECT_TRUE(s.join(2, req("b", 2, 4), t).empty());
  ASSERT_TRUE(s.nextDeadline());
  EXPECT_EQ(*s.nextDeadline(), t + 500ms);
  EXPECT_TRUE(s.tick(t + 499ms).empty());
  const auto a = assigned(s.tick(t + 500ms));
  EXPECT_EQ(a.size(), 2u);
  EXPECT_EQ(a.begin()->second.worldSize, 2);
}

TEST(Rounds, ALateJoinerEndsTheRunningRoundBelowMax) {
  RoundState s;
  const auto t = Clock::now();
  s.join(1, req("a", 1, 3), t);
  assigned(s.tick(t + 1s));
  ASSERT_TRUE(s.running());
  const auto events = s.join(2, req("b", 1, 3), t + 2s);
  EXPECT_EQ(count(events, EventKind::kRoundEnded), 1);
  EXPECT_NE(events.front().reason.find("node b joined"), std::string::npos);
  EXPECT_FALSE(s.running());
  // The old member re-joins; the next round has both, at once: nobody else is expected.
  const auto a = assigned(s.join(1, req("a", 1, 3), t + 2s));
  EXPECT_EQ(a.size(), 2u);
  EXPECT_EQ(a.begin()->second.round, 1);
}

TEST(Rounds, AfterARestartTheRoundCompletesOnceThePreviousMembersAreBack) {
  RoundState s;
  const auto t = Clock::now();
  for (AgentId id : {1, 2, 3}) s.join(id, req("n" + std::to_string(id), 2, 4), t);
  ASSERT_EQ(assigned(s.tick(t + 500ms)).size(), 3u);
  s.endRound(1, "restart", t + 1s);
  // Node 3 is lost on the way; 1 and 2 come back and need no last-call wait for it.
  s.leave(3, "connection closed", t + 1s);
  EXPECT_TRUE(s.join(1, req("n1", 2, 4), t + 1s).empty());
  const auto a = assigned(s.join(2, req("n2", 2, 4), t + 1s));
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a.at(1).worldSize, 2);
}

TEST(Rounds, FailuresCountAgainstMaxRestartsAndMembershipChangesDoNot) {
  RoundState s;
  const auto t = Clock::now();
  auto r = [](const std::string& node) {
    auto j = req(node, 2, 2);
    j.maxRestarts = 1;
    return j;
  };
  s.join(1, r("a"), t);
  ASSERT_EQ(assigned(s.join(2, r("b"), t)).at(1).restartCount, 0);
  // A membership change (b's connection drops, b comes back) does not count.
  s.leave(2, "connection closed", t);
  s.join(1, r("a"), t);
  ASSERT_EQ(assigned(s.join(2, r("b"), t)).at(2).restartCount, 0);
  // A worker failure does, and every node sees the same count and the failure.
  const auto ended = s.endRound(2, "rank 1 failed", t, R"({"rank":1})");
  ASSERT_EQ(count(ended, EventKind::kRoundEnded), 2);
  EXPECT_EQ(ended[0].failure, R"({"rank":1})");
  s.join(1, r("a"), t);
  const auto again = assigned(s.join(2, r("b"), t));
  EXPECT_EQ(again.at(1).restartCount, 1);
  EXPECT_EQ(again.at(2).restartCount, 1);
  // The second failure is one too many: the run fails for everyone, with that failure.
  const auto failed = s.endRound(1, "rank 0 failed", t, R"({"rank":0})");
  ASSERT_EQ(count(failed, EventKind::kRunFailed), 2);
  EXPECT_EQ(failed[0].failure, R"({"rank":0})");
  EXPECT_NE(failed[0].reason.find("no restart left"), std::string::npos) << failed[0].reason;
  EXPECT_TRUE(s.closed());
}

TEST(Rounds, AStaleRestartRequestChangesNothing) {
  RoundState s;
  const auto t = Clock::now();
  s.join(1, req("a", 2, 2), t);
  s.join(2, req("b", 2, 2), t);
  s.endRound(1, "rank 0 failed", t, "{}");
  // b's own failure report crossed the news: b is no longer a member, nothing happens.
  EXPECT_TRUE(s.endRound(2, "rank 1 failed", t, "{}").empty());
  EXPECT_EQ(s.restartCount(), 1);
}

TEST(Rounds, TheRunFinishesWhenEveryMemberSucceeded) {
  RoundState s;
  const auto t = Clock::now();
  s.join(1, req("a", 2, 2), t);
  s.join(2, req("b", 2, 2), t);
  EXPECT_TRUE(s.succeeded(1).empty());
  const auto events = s.succeeded(2);
  EXPECT_EQ(count(events, EventKind::kRunFinished), 2);
  EXPECT_TRUE(s.closed());
  // A node that comes later is told the run is over.
  const auto later = s.join(3, req("c", 2, 2), t);
  ASSERT_EQ(later.size(), 1u);
  EXPECT_EQ(later[0].kind, EventKind::kRunClosed);
}

TEST(Rounds, EventPayloadsRoundTrip) {
  Event e{1, EventKind::kRoundEnded, {}, "node a asked to restart", R"({"rank":3,"host":"x"})"};
  Event back{1, EventKind::kRoundEnded};
  decodeEventPayload(encodeEventPayload(e), back);
  EXPECT_EQ(back.reason, e.reason);
  EXPECT_EQ(back.failure, R"({"host":"x","rank":3})");
  Event plain{1, EventKind::kRunClosed, {}, "bye"};
  Event plainBack{1, EventKind::kRunClosed};
  decodeEventPayload(encodeEventPayload(plain), plainBack);
  EXPECT_TRUE(plainBack.failure.empty());
  EXPECT_THROW(decodeEventPayload("not json", plainBack), ProtocolError);
}

TEST(Rounds, AJoinerAtMaxWaitsOnStandby) {
  RoundState s;
  const auto t = Clock::now();
  s.join(1, req("a", 1, 1), t);
  ASSERT_TRUE(s.running());
  const auto spare = s.join(2, req("b", 1, 1), t);
  ASSERT_EQ(spare.size(), 1u);
  EXPECT_EQ(spare[0].kind, EventKind::kSpare);
  EXPECT_NE(spare[0].reason.find("node b waits as a spare"), std::string::npos) << spare[0].reason;
  // A spare waits past its join timeout while the round runs.
  s.heartbeat(1, t + 59s);
  EXPECT_TRUE(s.tick(t + 60s).empty());
  // When the member leaves, the standby node forms the next round.
  const auto events = s.leave(1, "connection closed", t + 61s);
  const auto a = assigned(events);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(a.begin()->first, 2u);
}

// The request of an agent that was node `rank` of round `round` (restart count `restarts`).
JoinRequest back(JoinRequest r, int round, int rank, int restarts = 0) {
  r.lastRound = round;
  r.lastRank = rank;
  r.restarts = restarts;
  return r;
}

// Survivors keep their node ranks; a spare takes the lost node's; the others are not renumbered.
TEST(Rounds, ASpareTakesTheNodeRankOfTheLostNodeAndSurvivorsKeepTheirs) {
  RoundState s;
  const auto t = Clock::now();
  for (AgentId id = 1; id <= 4; ++id) s.join(id, req(std::string(1, static_cast<char>('a' + id - 1)), 4, 4, 2), t);
  ASSERT_TRUE(s.running());
  const auto told = s.join(9, req("z-spare", 4, 4, 2), t);
  ASSERT_EQ(count(told, EventKind::kSpare), 1);
  // It knows the successors (b, c, d by node rank: none serves here, so a too).
  ASSERT_EQ(told[0].assignment.successors.size(), 4u);
  EXPECT_EQ(told[0].assignment.successors[1].node, "b");
  // b (node rank 1) is lost; the survivors come back with what they were.
  s.leave(2, "connection closed", t + 1s);
  s.join(1, back(req("a", 4, 4, 2), 0, 0), t + 1s);
  s.join(3, back(req("c", 4, 4, 2), 0, 2), t + 1s);
  const auto a = assigned(s.join(4, back(req("d", 4, 4, 2), 0, 3), t + 1s));
  ASSERT_EQ(a.size(), 4u);
  EXPECT_EQ(a.at(1).nodeRank, 0);
  EXPECT_EQ(a.at(9).nodeRank, 1);
  EXPECT_EQ(a.at(9).rankOffset, 2);
  EXPECT_EQ(a.at(3).nodeRank, 2);
  EXPECT_EQ(a.at(4).nodeRank, 3);
  EXPECT_EQ(a.at(4).worldSize, 8);
}

// Joiners left over when a round forms at max_nodes are told they wait as spares.
TEST(Rounds, JoinersLeftOverWhenARoundFormsAreToldTheyAreSpares) {
  RoundState s;
  const auto t = Clock::now();
  s.join(1, req("a", 2, 3), t);
  s.join(2, req("b", 2, 3), t);
  s.join(3, req("c", 2, 3), t);  // max: the round forms
  ASSERT_TRUE(s.running());
  // A fourth one during the round is a spare at once; the wire keeps its successors.
  const auto events = s.join(4, req("d", 2, 3), t);
  ASSERT_EQ(count(events, EventKind::kSpare), 1);
  Event decoded{4, EventKind::kSpare};
  decodeEventPayload(encodeEventPayload(events[0]), decoded);
  ASSERT_EQ(decoded.assignment.successors.size(), 3u);
  EXPECT_EQ(decoded.assignment.successors[2].address, "c.addr");
  // Two more at once when none runs: the round of three forms, the fourth is told.
  RoundState u;
  u.join(1, req("a", 3, 3), t);
  u.join(2, req("b", 3, 3), t);
  u.leave(2, "gone", t);
  u.join(5, req("e", 3, 3), t);
  const auto formed = u.join(6, req("f", 3, 3), t);
  EXPECT_EQ(assigned(formed).size(), 3u);
  EXPECT_EQ(count(u.join(7, req("g", 3, 3), t), EventKind::kSpare), 1);
}

// Two members silent in the same tick (a partition cut them off together): both are dropped,
// the survivor is told once, and the timer goes on (it threw map::at here once).
TEST(Rounds, TwoMembersSilentInOneTickAreBothDroppedAndTheSurvivorIsTold) {
  RoundState s;
  const auto t = Clock::now();
  for (AgentId id = 1; id <= 3; ++id) s.join(id, req(std::string(1, static_cast<char>('a' + id - 1)), 1, 3), t);
  ASSERT_TRUE(s.running());
  s.heartbeat(1, t + 1900ms);
  std::vector<Event> events;
  ASSERT_NO_THROW(events = s.tick(t + 2s));
  EXPECT_EQ(count(events, EventKind::kDisconnect), 2);
  const auto toSurvivor = std::count_if(events.begin(), events.end(), [](const Event& e) {
    return e.kind == EventKind::kRoundEnded && e.agent == 1u;
  });
  EXPECT_EQ(toSurvivor, 1);
  // The survivor alone forms the next round at once (min 1): nobody else is expected back.
  const auto a = assigned(s.join(1, back(req("a", 1, 3), 0, 0), t + 2s));
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(a.at(1).nnodes, 1);
}

// Without a spare the survivors close ranks in their old order.
TEST(Rounds, WithoutASpareTheSurvivorsCloseRanksInTheirOldOrder) {
  RoundState s;
  const auto t = Clock::now();
  for (AgentId id = 1; id <= 3; ++id) s.join(id, req(std::string(1, static_cast<char>('a' + id - 1)), 2, 3), t);
  s.leave(1, "connection closed", t + 1s);
  s.join(2, back(req("b", 2, 3), 0, 1), t + 1s);
  const auto a = assigned(s.join(3, back(req("c", 2, 3), 0, 2), t + 1s));
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a.at(2).nodeRank, 0);
  EXPECT_EQ(a.at(3).nodeRank, 1);
  EXPECT_EQ(a.at(2).round, 1);
}

// A server started by a successor goes on with the run's round numbers and restart count, and
// names the successors (never the agent that serves) in each assignment.
TEST(Rounds, AServerThatTookOverGoesOnWithTheRunsNumbering) {
  RoundState s;
  const auto t = Clock::now();
  auto b = back(req("b", 2, 3), 7, 1, 2);
  b.servesRendezvous = true;
  s.join(2, b, t);
  const auto a = assigned(s.join(3, back(req("c", 2, 3), 7, 2, 2), t));
  // Two of at most three: after the last call.
  const auto later = a.empty() ? assigned(s.tick(t + 1s)) : a;
  ASSERT_EQ(later.size(), 2u);
  EXPECT_EQ(later.at(2).round, 8);
  EXPECT_EQ(later.at(2).restartCount, 2);
  EXPECT_EQ(later.at(2).nodeRank, 0);
  ASSERT_EQ(later.at(2).successors.size(), 1u);
  EXPECT_EQ(later.at(2).successors[0].node, "c");
  EXPECT_EQ(later.at(2).successors[0].address, "c.addr");
  // The wire keeps them.
  const auto decoded = decodeAssignment(encodeAssignment(later.at(3)));
  ASSERT_EQ(decoded.successors.size(), 1u);
  EXPECT_EQ(decoded.successors[0].address, "c.addr");
  const auto join = decodeJoin(encodeJoin(b));
  EXPECT_EQ(join.lastRound, 7);
  EXPECT_EQ(join.lastRank, 1);
  EXPECT_EQ(join.restarts, 2);
  EXPECT_TRUE(join.servesRendezvous);
}

// A node whose program differs from the run's is refused, with both command lines.
TEST(Rounds, ANodeRunningAnotherProgramIsRefusedNamingBoth) {
  RoundState s;
  const auto t = Clock::now();
  auto a = req("a", 1, 1);
  a.program = "./train --lr 0.1";
  s.join(1, a, t);
  auto b = req("b", 1, 1);
  b.program = "./train --lr 0.2";
  const auto events = s.join(2, b, t);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, EventKind::kJoinFailed);
  EXPECT_EQ(events[0].reason, "node b runs './train --lr 0.2' but the run runs './train --lr 0.1': refused");
}

// A side of a partition below the minimum forms no round and says why.
TEST(Rounds, ASideBelowTheMinimumAfterARoundTimesOutNamingAPartition) {
  RoundState s;
  const auto t = Clock::now();
  s.join(1, req("a", 2, 3), t);
  s.join(2, req("b", 2, 3), t);
  s.tick(t + 1s);  // last call: the round of two forms
  ASSERT_TRUE(s.running());
  s.leave(2, "no heartbeat", t + 2s);
  s.join(1, back(req("a", 2, 3), 0, 0), t + 2s);
  const auto events = s.tick(t + 13s);
  ASSERT_EQ(count(events, EventKind::kJoinFailed), 1);
  const auto it = std::find_if(events.begin(), events.end(), [](const Event& e) { return e.kind == EventKind::kJoinFailed; });
  EXPECT_NE(it->reason.find("1 of 2 nodes needed have joined since round 0 ended"), std::string::npos) << it->reason;
  EXPECT_NE(it->reason.find("network partition"), std::string::npos) << it->reason;
}

TEST(Rounds, ALeavingMemberEndsTheRoundForEveryoneWithTheReason) {
  RoundState s;
  const auto t = Clock::now();
  s.join(1, req("a", 2, 2), t);
  s.join(2, req("b", 2, 2), t);
  const auto events = s.leave(1, "connection closed", t);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].agent, 2u);
  EXPECT_EQ(events[0].kind, EventKind::kRoundEnded);
  EXPECT_EQ(events[0].reason, "node a left: connection closed");
}

TEST(Rounds, MissedHeartbeatsDisconnectTheSilentMember) {
  RoundState s;
  const auto t = Clock::now();
  s.join(1, req("a", 2, 2), t);
  s.join(2, req("b", 2, 2), t);
  s.heartbeat(2, t + 1500ms);
  EXPECT_TRUE(s.tick(t + 1999ms).empty());
  const auto events = s.tick(t + 2s);
  EXPECT_EQ(count(events, EventKind::kDisconnect), 1);
  EXPECT_EQ(count(events, EventKind::kRoundEnded), 1);
  const auto ended = std::find_if(events.begin(), events.end(), [](const Event& e) { return e.kind == EventKind::kRoundEnded; });
  EXPECT_EQ(ended->agent, 2u);
  EXPECT_NE(ended->reason.find("no heartbeat for 2000 ms"), std::string::npos);
}

TEST(Rounds, RestartRequestEndsTheRoundForAllMembers) {
  RoundState s;
  const auto t = Clock::now();
  s.join(1, req("a", 2, 2), t);
  s.join(2, req("b", 2, 2), t);
  const auto events = s.endRound(2, "worker rank 3 exited with code 1", t);
  EXPECT_EQ(count(events, EventKind::kRoundEnded), 2);
}

TEST(Rounds, CloseIsFinalForMembersWaitersAndLaterJoiners) {
  RoundState s;
  const auto t = Clock::now();
  s.join(1, req("a", 2, 2), t);
  const auto events = s.close("job finished");
  EXPECT_EQ(count(events, EventKind::kRunClosed), 1);
  const auto later = s.join(2, req("b", 2, 2), t);
  ASSERT_EQ(later.size(), 1u);
  EXPECT_EQ(later[0].kind, EventKind::kRunClosed);
  EXPECT_EQ(later[0].reason, "job finished");
}

TEST(Rounds, JoinTimeoutSaysHowManyNodesCame) {
  RoundState s;
  const auto t = Clock::now();
  s.join(1, req("a", 3, 3), t);
  const auto events = s.tick(t + 10s);
  ASSERT_EQ(count(events, EventKind::kJoinFailed), 1);
  EXPECT_NE(events[0].reason.find("1 of 3"), std::string::npos) << events[0].reason;
}

TEST(Rounds, MismatchedNodeCountsAreRefused) {
  RoundState s;
  const auto t = Clock::now();
  s.join(1, req("a", 2, 2), t);
  const auto events = s.join(2, req("b", 3, 3), t);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, EventKind::kJoinFailed);
}

TEST(Rounds, JoinAndAssignmentRoundTripThroughJson) {
  const auto r = req("n", 1, 4, 8, 2);
  const auto back = decodeJoin(encodeJoin(r));
  EXPECT_EQ(back.node, "n");
  EXPECT_EQ(back.localWorldSize, 8);
  EXPECT_EQ(back.preferredRank, 2);
  EXPECT_EQ(back.lastCallTimeout, 500ms);
  EXPECT_THROW(decodeJoin("{}"), ProtocolError);
  EXPECT_THROW(decodeJoin("not json"), ProtocolError);
  auto bad = r;
  bad.localWorldSize = 0;
  EXPECT_THROW(decodeJoin(encodeJoin(bad)), ProtocolError);
  const Assignment a{3, 1, 8, 16, 2, "h", 29500, 2, true};
  const auto ab = decodeAssignment(encodeAssignment(a));
  EXPECT_EQ(ab.rankOffset, 8);
  EXPECT_EQ(ab.restartCount, 2);
  EXPECT_TRUE(ab.pytorchStore);
}

}  // namespace
}  // namespace fsdp::rendezvous
