// DistributedSampler and DataLoader: every example once per epoch over the ranks, the same
// global order whatever the world size, reproducible per seed and epoch, resumable positions.
#include "fsdp/worker/data.hpp"

#include <ATen/Functions.h>
#include <gtest/gtest.h>

#include <set>

#include "fsdp/common/error.hpp"

namespace fsdp::worker {
namespace {

std::vector<std::int64_t> values(const at::Tensor& t) {
  const auto c = t.contiguous();
  return std::vector<std::int64_t>(c.data_ptr<std::int64_t>(), c.data_ptr<std::int64_t>() + c.numel());
}

// The global batch of a step, as the ranks' slices in rank order.
std::vector<std::int64_t> globalBatch(std::int64_t size, int world, const SamplerOptions& o,
                                      const SamplerPosition& at) {
  std::vector<std::int64_t> all;
  for (int r = 0; r < world; ++r) {
    const auto mine = values(DistributedSampler(size, r, world, o).indices(at));
    all.insert(all.end(), mine.begin(), mine.end());
  }
  return all;
}

TEST(DistributedSampler, EveryExampleOncePerEpochOverTheRanks) {
  const SamplerOptions o{.globalBatch = 10, .seed = 7};
  DistributedSampler s(103, 0, 3, o);
  EXPECT_EQ(s.stepsPerEpoch(), 11);  // the last global batch has 3 examples
  std::multiset<std::int64_t> seen;
  for (std::int64_t step = 0; step < s.stepsPerEpoch(); ++step) {
    const auto batch = globalBatch(103, 3, o, {0, step});
    EXPECT_EQ(static_cast<std::int64_t>(batch.size()), s.globalBatchAt(step));
    seen.insert(batch.begin(), batch.end());
  }
  EXPECT_EQ(seen.size(), 103u);
  EXPECT_EQ(std::set<std::int64_t>(seen.begin(), seen.end()).size(), 103u);
}

TEST(DistributedSampler, TheGlobalOrderDoesNotDependOnTheWorldSize) {
  const SamplerOptions o{.globalBatch = 12, .seed = 3};
  for (const std::int64_t step : {0, 4, 8}) {
    const auto one = globalBatch(100, 1, o, {1, step});
    EXPECT_EQ(globalBatch(100, 2, o, {1, step}), one);
    EXPECT_EQ(globalBatch(100, 4, o, {1, step}), one);
  }
}

TEST(DistributedSampler, ReshufflesPerEpochReproduciblyPerSeed) {
  const SamplerOptions o{.globalBatch = 50, .seed = 11};
  DistributedSampler s(50, 0, 1, o);
  EXPECT_NE(values(s.indices({0, 0})), values(s.indices({1, 0})));
  EXPECT_EQ(values(s.indices({1, 0})), values(DistributedSampler(50, 0, 1, o).indices({1, 0})));
  SamplerOptions other = o;
  other.seed = 12;
  EXPECT_NE(values(s.indices({1, 0})), values(DistributedSampler(50, 0, 1, other).indices({1, 0})));
  other.shuffle = false;
  EXPECT_EQ(values(DistributedSampler(50, 0, 1, other).indices({0, 0}))[7], 7);
}

TEST(DistributedSampler, DropLastAndPadShapeTheLastBatch) {
  DistributedSampler drop(25, 0, 2, {.globalBatch = 10, .lastBatch = LastBatch::kDrop});
  EXPECT_EQ(drop.stepsPerEpoch(), 2);
  const SamplerOptions pad{.globalBatch = 10, .lastBatch = LastBatch::kPad};
  DistributedSampler padded(25, 1, 2, pad);
  EXPECT_EQ(padded.stepsPerEpoch(), 3);
  EXPECT_EQ(padded.globalBatchAt(2), 10);
  const auto last = globalBatch(25, 2, pad, {0, 2});
  ASSERT_EQ(last.size(), 10u);
  // Five real examples, then the start of the epoch's order again.
  const auto first = globalBatch(25, 2, pad, {0, 0});
  EXPECT_EQ(std::vector<std::int64_t>(last.begin() + 5, last.end()),
            std::vector<std::int64_t>(first.begin(), first.begin() + 5));
}

TEST(DistributedSampler, PositionsRollOverToTheNextEpoch) {
  DistributedSampler s(30, 0, 1, {.globalBatch = 10});
  EXPECT_EQ(s.next({0, 1}), (SamplerPosition{0, 2}));
  EXPECT_EQ(s.next({0, 2}), (SamplerPosition{1, 0}));
}

TEST(DistributedSampler, BadSettingsAreConfigErrors) {
  EXPECT_THROW(DistributedSampler(0, 0, 1, {.globalBatch = 1}), ConfigError);
  EXPECT_THROW(DistributedSampler(10, 0, 4, {.globalBatch = 3}), ConfigError);
  EXPECT_THROW(DistributedSampler(5, 0, 1, {.globalBatch = 8, .lastBatch = LastBatch::kDrop}), ConfigError);
}

// A dataset whose examples are their own indices; one index fails on request.
class IndexDataset : public Dataset {
 public:
  explicit IndexDataset(std::int64_t n, std::int64_t poison = -1) : n_(n), poison_(poison) {}
  std::int64_t size() const override { return n_; }
  Batch get(const at::Tensor& indices) const override {
    if (poison_ >= 0 && indices.eq(poison_).any().item<bool>()) throw ConfigError("example " + std::to_string(poison_) + " is unreadable");
    return {indices.to(at::kFloat), indices.clone(), 0};
  }

 private:
  std::int64_t n_;
  std::int64_t poison_;
};

TEST(DataLoader, YieldsTheSamplersBatchesInOrderFromAnyPositionAcrossEpochs) {
  IndexDataset data(23);
  DistributedSampler sampler(23, 1, 2, {.globalBatch = 8, .seed = 5});
  DataLoader loader(data, sampler, {0, 2}, 3);
  SamplerPosition expect{0, 2};
  for (int i = 0; i < 7; ++i) {
    const auto item = loader.next();
    EXPECT_EQ(item.position, expect);
    EXPECT_EQ(values(item.batch.target), values(sampler.indices(expect)));
    EXPECT_EQ(item.globalBatch, sampler.globalBatchAt(expect.step));
    expect = sampler.next(expect);
  }
}

TEST(DataLoader, AnErrorOfTheDatasetReachesTheConsumer) {
  IndexDataset data(20, 13);
  DistributedSampler sampler(20, 0, 1, {.globalBatch = 4, .shuffle = false});
  DataLoader loader(data, sampler, {0, 0});
  loader.next();
  loader.next();
  loader.next();
  EXPECT_THROW(loader.next(), ConfigError);  // the batch with example 13
}

TEST(TokenWindowDataset, TargetsAreTheInputsShiftedByOne) {
  TokenWindowDataset data(at::arange(20, at::kLong), 4);
  EXPECT_EQ(data.size(), 16);
  const auto b = data.get(at::tensor({0, 10}, at::kLong));
  EXPECT_EQ(values(b.input.reshape({-1})), std::vector<std::int64_t>({0, 1, 2, 3, 10, 11, 12, 13}));
  EXPECT_EQ(values(b.target.reshape({-1})), std::vector<std::int64_t>({1, 2, 3, 4, 11, 12, 13, 14}));
  EXPECT_EQ(b.tokens, 8);
}

}  // namespace
}  // namespace fsdp::worker
