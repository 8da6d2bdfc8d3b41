// Which in-memory snapshot a restore takes (worker/src/checkpoint/snapshot/snapshot_restore.hpp):
// dropAbandoned leaves out the pieces of a trajectory a later round left, chooseSnapshot takes
// the newest step every rank is held at. A restore must never mix two trajectories: after a
// round resumed from step T, the steps past T it redoes need not be the same bits as the ones
// the round before took (nondeterministic kernels), so a rank's old piece of such a step beside
// another rank's new one is a state no run ever had.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "checkpoint/snapshot/snapshot_restore.hpp"

namespace {

using fsdp::worker::detail::chooseSnapshot;
using fsdp::worker::detail::dropAbandoned;
using fsdp::worker::detail::HeldPiece;
using fsdp::worker::detail::holdingsText;
using fsdp::worker::detail::NodeHoldings;
using fsdp::worker::detail::parseHoldings;

HeldPiece piece(int rank, int world, std::int64_t step, int round, bool peer = false) {
  return {.rank = rank, .world = world, .step = step, .peer = peer, .round = round};
}

// Two nodes, one rank each, each holding the other's peer copy. Round 1: rank 0 reached step 11,
// rank 1 step 10; round 2 resumed from 10 and rank 1 put its step 11 again, then a second
// failure came before rank 0's put of 11. Node 0's keeper never saw a put of round 2.
TEST(SnapshotChoice, AStepRedoneByANewerRoundIsNotMixedWithTheOldPiecesOfIt) {
  std::vector<NodeHoldings> nodes(2);
  nodes[0].pieces = {piece(0, 2, 10, 1), piece(0, 2, 11, 1), piece(1, 2, 10, 1, true)};
  nodes[1].pieces = {piece(1, 2, 10, 1), piece(1, 2, 11, 2), piece(0, 2, 10, 1, true), piece(0, 2, 11, 1, true)};
  // Without the filter, step 11 is "complete": rank 0's old bits beside rank 1's new ones.
  EXPECT_EQ(chooseSnapshot(nodes, 2).step, 11);
  dropAbandoned(nodes);
  const auto choice = chooseSnapshot(nodes, 2);
  EXPECT_EQ(choice.step, 10);
  EXPECT_EQ(choice.world, 2);
  EXPECT_EQ(nodes[0].pieces.size(), 2u);  // rank 0's own 10 and rank 1's copy of 10
  EXPECT_EQ(nodes[1].pieces.size(), 3u);  // rank 1's 10 and 11, rank 0's copy of 10
}

// A round that resumed from disk further back (step 6) leaves every older round's piece from 6
// on; another world's pieces count the same (a reshard is a resume too).
TEST(SnapshotChoice, AResumeFromFurtherBackLeavesOutEveryOlderPieceFromItsFirstStepOn) {
  std::vector<NodeHoldings> nodes(1);
  nodes[0].pieces = {piece(0, 3, 5, 1), piece(1, 3, 5, 1), piece(2, 3, 5, 1), piece(0, 3, 8, 1),
                     piece(1, 3, 8, 1), piece(2, 3, 8, 1), piece(0, 2, 6, 3)};
  dropAbandoned(nodes);
  EXPECT_EQ(nodes[0].pieces.size(), 4u);
  const auto choice = chooseSnapshot(nodes, 2);
  EXPECT_EQ(choice.step, 5);  // world 2 holds only rank 0 at 6; world 3's step 8 is left out
  EXPECT_EQ(choice.world, 3);
}

TEST(SnapshotChoice, TheHoldingsTextCarriesTheRoundAndMalformedEntriesAreLeftOut) {
  NodeHoldings h;
  h.endpoint = "10.0.0.1:4000";
  h.pieces = {piece(1, 4, 12, 7, true)};
  const auto back = parseHoldings(holdingsText(h));
  ASSERT_EQ(back.pieces.size(), 1u);
  EXPECT_EQ(back.pieces[0].round, 7);
  EXPECT_TRUE(back.pieces[0].peer);
  EXPECT_EQ(back.endpoint, h.endpoint);
  EXPECT_TRUE(parseHoldings(R"({"pieces": [[0, 1, 3, false], [0, 1, 3, false, "x"], [5, 2, 1, false, 1]]})")
                  .pieces.empty());
}

// The reference, written the slow way: the newest (step, world) at which, for some round r,
// every rank of world is held at round r and no newer round holds any piece at that step or
// before it. Ties as chooseSnapshot breaks them.
std::pair<std::int64_t, int> reference(const std::vector<NodeHoldings>& nodes, int currentWorld) {
  std::pair<std::int64_t, int> best{-1, 0};
  std::set<std::tuple<int, int, std::int64_t, int>> all;  // rank, world, step, round
  for (const auto& n : nodes)
    for (const auto& p : n.pieces) all.insert({p.rank, p.world, p.step, p.round});
  for (const auto& [rank0, world, step, round] : all) {
    bool complete = true;
    for (int q = 0; q < world && complete; ++q) complete = all.contains({q, world, step, round});
    for (const auto& [r2, w2, s2, round2] : all) complete = complete && !(round2 > round && s2 <= step);
    if (!complete) continue;
    const bool better = best.second == 0 || step > best.first ||
                        (step == best.first && ((world == currentWorld && best.second != currentWorld) ||
                                                ((world == currentWorld) == (best.second == currentWorld) &&
                                                 world > best.second)));
    if (better) best = {step, world};
  }
  return best;
}

// Seeded histories: each round, the ranks resume from the step chooseSnapshot picks (after
// dropAbandoned), each goes on a random number of steps putting a piece per step on its node
// and a peer copy on the next node (the copy sometimes not there yet), nodes keep only their
// newest pieces, and a node may be lost with everything it held. The chosen step's pieces are
// always of one round (never two trajectories) and agree with the reference.
TEST(SnapshotChoice, GeneratedHistoriesNeverMixTwoRoundsAndMatchTheReference) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int history = 0; history < 300; ++history) {
    const int world = 2 + static_cast<int>(rng() % 3);  // a rank per node
    std::vector<NodeHoldings> nodes(static_cast<std::size_t>(world));
    std::int64_t from = 0;
    for (int round = 1; round <= 6; ++round) {
      for (int r = 0; r < world; ++r) {
        const std::int64_t reach = from + static_cast<std::int64_t>(rng() % 4);
        for (std::int64_t s = from + 1; s <= reach; ++s) {
          auto& own = nodes[static_cast<std::size_t>(r)].pieces;
          std::erase_if(own, [&](const HeldPiece& p) { return p.rank == r && !p.peer && p.step >= s; });
          own.push_back(piece(r, world, s, round));
          if (s < reach || rng() % 2 == 0) {
            auto& next = nodes[static_cast<std::size_t>((r + 1) % world)].pieces;
            std::erase_if(next, [&](const HeldPiece& p) { return p.rank == r && p.peer && p.step >= s; });
            next.push_back(piece(r, world, s, round, true));
          }
        }
      }
      for (auto& n : nodes) {  // a keeper's newest 3 own pieces of a rank, 2 peer copies
        std::map<std::pair<int, bool>, std::vector<std::int64_t>> steps;
        for (const auto& p : n.pieces) steps[{p.rank, p.peer}].push_back(p.step);
        std::erase_if(n.pieces, [&](const HeldPiece& p) {
          auto v = steps[{p.rank, p.peer}];
          std::sort(v.rbegin(), v.rend());
          const std::size_t keep = p.peer ? 2 : 3;
          return v.size() > keep && p.step < v[keep - 1];
        });
      }
      if (rng() % 3 == 0) nodes[rng() % nodes.size()].pieces.clear();  // a node lost, its rank replaced
      auto seen = nodes;
      dropAbandoned(seen);
      const auto choice = chooseSnapshot(seen, world);
      const auto expected = reference(nodes, world);
      ASSERT_EQ(choice.step, expected.first) << "history " << history << " round " << round;
      if (choice.world == 0) {
        from = 0;  // from disk (here: the start)
        continue;
      }
      std::set<int> rounds;
      for (const auto& n : seen)
        for (const auto& p : n.pieces)
          if (p.step == choice.step && p.world == choice.world) rounds.insert(p.round);
      ASSERT_EQ(rounds.size(), 1u) << "step " << choice.step << " mixes rounds, history " << history;
      from = choice.step;
    }
  }
}

}  // namespace
