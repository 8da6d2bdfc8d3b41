// The examples under fsdprun with FSDP: real processes, real Gloo, real data.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "run_command.hpp"

namespace {

using fsdp::testing::runCommand;
using namespace std::chrono_literals;

const std::string kBin = FSDP_BIN_DIR;
const std::string kFsdprun = kBin + "/fsdprun";

// The JSON object on the last line rank 0 printed.
nlohmann::json summary(const std::string& out) {
  const auto start = out.rfind("\n{");
  return nlohmann::json::parse(out.substr(start == std::string::npos ? 0 : start + 1));
}

bool haveFashionMnist() { return std::filesystem::exists("/usr/share/datasets/fashion-mnist"); }

nlohmann::json trainMnist(int ranks, const std::string& sharding,
                          const std::vector<std::string>& extra = {}) {
  std::vector<std::string> argv = {kFsdprun,     "--standalone", "--nproc_per_node",
                                   std::to_string(ranks), kBin + "/mnist", "--max_steps", "12",
                                   "--log_every", "0",    "--no_dropout", "--sharding", sharding};
  argv.insert(argv.end(), extra.begin(), extra.end());
  const auto r = runCommand(argv, 300s);
  EXPECT_FALSE(r.timedOut) << r.err;
  EXPECT_EQ(r.exitCode, 0) << r.out << r.err;
  if (r.exitCode != 0) return {};
  return summary(r.out);
}

TEST(MnistFsdp, FullShardAndShardGradOpTrainToTheSameBits) {
  if (!haveFashionMnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  const auto full = trainMnist(2, "FULL_SHARD");
  const auto gradOp = trainMnist(2, "SHARD_GRAD_OP");
  ASSERT_FALSE(full.is_null());
  ASSERT_FALSE(gradOp.is_null());
  // The same all-gathers and reduce-scatters in a different schedule: identical weights.
  EXPECT_EQ(full["params_sha256"], gradOp["params_sha256"]);
  EXPECT_GT(full["test_accuracy"].get<double>(), 0.5) << full.dump();
  EXPECT_EQ(full["sharding"], "FULL_SHARD");
}

TEST(MnistFsdp, GradientAccumulationMatchesTheWholeGlobalBatch) {
  if (!haveFashionMnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  // Two micro-batches per rank (the first under noSync) against one: the same global batch
  // and the same mean gradient, so the same model up to float rounding.
  const auto whole = trainMnist(2, "FULL_SHARD", {"--model", "shallow"});
  const auto split = trainMnist(2, "FULL_SHARD", {"--model", "shallow", "--grad_accumulation", "2"});
  ASSERT_FALSE(whole.is_null());
  ASSERT_FALSE(split.is_null());
  EXPECT_NEAR(split["test_loss"].get<double>(), whole["test_loss"].get<double>(), 1e-4)
      << whole.dump() << "\n" << split.dump();
  EXPECT_NEAR(split["test_accuracy"].get<double>(), whole["test_accuracy"].get<double>(), 2e-3);
}

TEST(MnistFsdp, NoShardHybridShardAndBf16Train) {
  if (!haveFashionMnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  for (const auto& [ranks, sharding, precision] :
       std::vector<std::tuple<int, std::string, std::string>>{
           {2, "NO_SHARD", "no"}, {4, "HYBRID_SHARD", "no"}, {2, "FULL_SHARD", "bf16"}}) {
    const auto s = trainMnist(ranks, sharding, {"--mixed_precision", precision});
    ASSERT_FALSE(s.is_null()) << sharding;
    EXPECT_EQ(s["world_size"], ranks);
    EXPECT_EQ(s["mixed_precision"], precision);
    EXPECT_GT(s["test_accuracy"].get<double>(), 0.5) << sharding << " " << s.dump();
  }
}

TEST(MnistFsdp, ABadShardingIsAUsageError) {
  const auto r = runCommand({kBin + "/mnist", "--sharding", "HALF_SHARD"}, 60s);
  EXPECT_EQ(r.exitCode, 2) << r.err;
  EXPECT_NE(r.err.find("--sharding"), std::string::npos) << r.err;
}

TEST(GptFsdp, TwoRanksBeatTheUnigramBaselineAndSampleText) {
  if (!std::filesystem::exists("/usr/share/games/fortunes")) {
    GTEST_SKIP() << "fortunes is not installed";
  }
  const auto r = runCommand({kFsdprun, "--standalone", "--nproc_per_node", "2", kBin + "/gpt",
                             "--n_layer", "2", "--max_steps", "120", "--eval_every", "0",
                             "--log_every", "0", "--sample_chars", "80",
                             "--activation_checkpointing"},
                            300s);
  ASSERT_FALSE(r.timedOut) << r.err;
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  const auto s = summary(r.out);
  EXPECT_LT(s["test_loss"].get<double>(), s["unigram_loss"].get<double>()) << s.dump();
  EXPECT_TRUE(s["activation_checkpointing"].get<bool>());
  EXPECT_NE(r.out.find("--- sample ---"), std::string::npos) << r.out;
}

}  // namespace
