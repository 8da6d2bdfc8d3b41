// FSDP's collective of construction (worker/src/fsdp/builder.hpp, an internal): the model check
// every rank all-gathers also says whether a survivor of an earlier round re-forms in process
// with the group, which tells new processes to skip the broadcast of rank 0's weights.
#include <ATen/Functions.h>
#include <gtest/gtest.h>

#include <atomic>
#include <random>

#include "fsdp/common/error.hpp"
#include "fsdp/builder.hpp"
#include "torch_ranks.hpp"

namespace fsdp::worker {
namespace {

using fsdp::testing::RankContext;
using fsdp::testing::runRanks;

at::Tensor digest(std::int64_t salt) {
  auto words = at::arange(4, at::kLong);
  words[3] += salt;
  return words;
}

// Seeded survivor patterns over 3 ranks (none, one, several, all): every rank learns the same
// answer, whether any rank said it survives, and no pattern is taken for a model mismatch.
TEST(ConstructionCheck, EveryRankLearnsWhetherAnyRankOfTheGroupIsASurvivor) {
  const unsigned seed = 20261129;
  std::mt19937 rng(seed);
  for (int pattern = 0; pattern < 8; ++pattern) {
    const int bits = pattern == 0 ? 0 : static_cast<int>(rng() % 8);
    const bool expected = bits != 0;
    std::atomic<int> agreed{0};
    runRanks(3, [&](RankContext& ctx) {
      const bool survivor = (bits >> ctx.rank) & 1;
      if (detail::compareModelDigests(ctx.comm, digest(0), survivor) == expected) ++agreed;
    });
    EXPECT_EQ(agreed.load(), 3) << "seed " << seed << ", survivors (bit per rank) " << bits;
  }
}

TEST(ConstructionCheck, AModelThatDiffersIsNamedWhateverTheSurvivorsSay) {
  std::atomic<int> refused{0};
  runRanks(3, [&](RankContext& ctx) {
    try {
      detail::compareModelDigests(ctx.comm, digest(ctx.rank == 2 ? 1 : 0), /*survivor=*/ctx.rank == 0);
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 2's model differs from rank 0's"), std::string::npos) << e.what();
      ++refused;
    }
  });
  EXPECT_EQ(refused.load(), 3);
}

TEST(ConstructionCheck, AWorldOfOneIsItsOwnAnswer) {
  runRanks(1, [&](RankContext& ctx) {
    EXPECT_TRUE(detail::compareModelDigests(ctx.comm, digest(0), true));
    EXPECT_FALSE(detail::compareModelDigests(ctx.comm, digest(0), false));
  });
}

}  // namespace
}  // namespace fsdp::worker
