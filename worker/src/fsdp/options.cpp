// The options' parsers and the auto-wrap policies users pick from.
#include <algorithm>

#include "builder.hpp"
#include "fsdp/common/error.hpp"

namespace fsdp::worker {

ShardingStrategy parseShardingStrategy(const std::string& text) {
  if (text == "FULL_SHARD") return ShardingStrategy::kFullShard;
  if (text == "SHARD_GRAD_OP") return ShardingStrategy::kShardGradOp;
  if (text == "NO_SHARD") return ShardingStrategy::kNoShard;
  if (text == "HYBRID_SHARD") return ShardingStrategy::kHybridShard;
  throw ConfigError("--sharding '" + text +
                    "': expected FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD");
}

const char* toString(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard: return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard: return "NO_SHARD";
    case ShardingStrategy::kHybridShard: return "HYBRID_SHARD";
  }
  return "?";
}

MixedPrecision MixedPrecision::parse(const std::string& text) {
  if (text == "no" || text.empty()) return {};
  if (text == "bf16") return {at::kBFloat16, at::kBFloat16, at::kBFloat16};
  if (text == "fp16") return {at::kHalf, at::kHalf, at::kHalf};
  throw ConfigError("--mixed_precision '" + text + "': expected no, bf16 or fp16");
}

AutoWrapPolicy AutoWrapPolicy::minParams(std::int64_t minNumParams) {
  return {[minNumParams](const torch::nn::Module&, const std::string&, std::int64_t numParams) {
    return numParams >= minNumParams;
  }};
}

AutoWrapPolicy AutoWrapPolicy::byTypeName(std::vector<std::string> typeNames) {
  for (auto& name : typeNames) name = detail::shortTypeName(name);
  return {[names = std::move(typeNames)](const torch::nn::Module& module, const std::string&,
                                         std::int64_t) {
    return std::find(names.begin(), names.end(), detail::shortTypeName(module.name())) != names.end();
  }};
}

}  // namespace fsdp::worker
