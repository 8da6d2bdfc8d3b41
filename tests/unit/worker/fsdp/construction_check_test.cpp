// FSDP's collective of construction (worker/src/fsdp/builder.hpp, an internal): the model check
// every rank all-gathers also says whether a survivor of an earlier round re-forms in process
// with the group, which tells new processes to skip the broadcast of rank 0's weights.
#include "fsdp/builder.hpp"

#include <ATen/Functions.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "fsdp/common/error.hpp"
#include "torch_ranks.hpp"

namespace fsdp::worker {
namespace {

using detail::CheckedBy;
using fsdp::testing::RankContext;
using fsdp::testing::runRanks;

at::Tensor digest(std::int64_t salt) {
  auto words = at::arange(4, at::kLong);
  words[3] += salt;
  return words;
}

// Every survivor pattern over 3 ranks (none, each one alone, each pair, all): every rank learns
// the same answer, whether any rank is a survivor, and no pattern is taken for a model mismatch.
TEST(ConstructionCheck, EveryRankLearnsWhetherAnyRankOfTheGroupIsASurvivor) {
  for (int bits = 0; bits < 8; ++bits) {
    const bool expected = bits != 0;
    std::atomic<int> agreed{0};
    runRanks(3, [&](RankContext& ctx) {
      const auto by = (bits >> ctx.rank) & 1 ? CheckedBy::kSurvivor : CheckedBy::kConstructor;
      if (detail::compareModelDigests(ctx.comm, digest(0), by) == expected) ++agreed;
    });
    EXPECT_EQ(agreed.load(), 3) << "survivors (a bit per rank): " << bits;
  }
}

TEST(ConstructionCheck, AModelThatDiffersIsNamedWhateverTheSurvivorsSay) {
  std::atomic<int> refused{0};
  runRanks(3, [&](RankContext& ctx) {
    const auto by = ctx.rank == 0 ? CheckedBy::kSurvivor : CheckedBy::kConstructor;
    try {
      detail::compareModelDigests(ctx.comm, digest(ctx.rank == 2 ? 1 : 0), by);
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("rank 2's model differs from rank 0's"), std::string::npos) << what;
      ++refused;
    }
  });
  EXPECT_EQ(refused.load(), 3);
}

TEST(ConstructionCheck, AWorldOfOneIsItsOwnAnswer) {
  runRanks(1, [&](RankContext& ctx) {
    EXPECT_TRUE(detail::compareModelDigests(ctx.comm, digest(0), CheckedBy::kSurvivor));
    EXPECT_FALSE(detail::compareModelDigests(ctx.comm, digest(0), CheckedBy::kConstructor));
  });
}

}  // namespace
}  // namespace fsdp::worker
