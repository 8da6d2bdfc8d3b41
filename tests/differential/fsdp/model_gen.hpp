#pragma once
// Random models and FSDP options for the differential test, drawn from one seed: the same seed
// always gives the same case (model, options, data), on every rank and in the reference.
//
// Models are pipelines of blocks of the kinds users build: Linear, Conv2d, LayerNorm,
// BatchNorm (buffers), an Embedding mixed into the input, Dropout, residual blocks, custom
// modules with members and a raw parameter, explicit fsdp::Unit members (holding a Sequential
// whose children auto-wrap can reach), a unit called twice in one forward, frozen parameters
// anywhere and whole frozen units, parameters outside every unit. The root is a Sequential
// (auto-wrap applies) or a custom module (units only where the model declares them).

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/worker/fsdp.hpp"

namespace fsdp::testing::diff {

// kShared: one Linear(d, d) module placed twice in its container, with a tanh between.
enum class BlockKind { kLinear, kTanh, kConv, kLayerNorm, kBatchNorm, kEmbed, kDropout, kResidual,
                       kCustom, kUnit, kTwice, kShared };

struct BlockSpec {
  BlockKind kind = BlockKind::kLinear;
  std::int64_t in = 0, out = 0;
  std::int64_t channels = 1, outChannels = 1, side = 1;  // kConv: [C, side, side] -> [C2, side, side]
  std::int64_t vocab = 0, taken = 0, width = 0;         // kEmbed
  double dropout = 0;                                     // kDropout
  bool frozenUnit = false;                                // kUnit: every parameter frozen
  std::vector<BlockSpec> inner;                           // kUnit: its Sequential's blocks
};

struct ModelSpec {
  std::int64_t in = 0, out = 0;
  bool sequentialRoot = true;
  bool rootParam = false;  // a raw parameter on the root, added to the output
  std::vector<BlockSpec> blocks;
  double freezeProbability = 0;
  std::uint64_t freezeSeed = 0;
};

enum class AutoWrapKind { kNone, kMinParams, kByTypeName };
enum class OptimizerKind { kSgd, kAdam };

struct CaseSpec {
  std::uint64_t seed = 0;
  ModelSpec model;
  int world = 1;
  worker::ShardingStrategy strategy = worker::ShardingStrategy::kFullShard;
  int hybridLocal = 1;  // HYBRID_SHARD: ranks per shard group
  AutoWrapKind autoWrap = AutoWrapKind::kNone;
  std::int64_t minParams = 0;
  std::vector<std::string> typeNames;
  worker::BackwardPrefetch backwardPrefetch = worker::BackwardPrefetch::kPre;
  bool forwardPrefetch = false;
  int limitAllGathers = 2;
  bool checkpointing = false;
  bool bf16 = false;        // bf16 parameters and buffers in compute
  bool bf16Reduce = false;  // ... and bf16 gradient reduction (else fp32)
  bool syncModuleStates = false;
  int microBatches = 1;  // > 1: the first ones under noSync()
  double clip = 0;
  OptimizerKind optimizer = OptimizerKind::kSgd;
  int steps = 3;
  std::vector<std::int64_t> localBatch;  // per rank
  bool dropout() const;                   // a Dropout with p > 0 is in the model
  std::string describe() const;           // one line
};

// Draws a case. `maxWorld` bounds the world size (1-4).
CaseSpec drawCase(std::uint64_t seed, int maxWorld = 4);

// A built model: a Sequential root, or a custom one behind an AnyModule.
struct Model {
  torch::nn::Sequential sequential{nullptr};
  torch::nn::AnyModule custom;
  torch::nn::Module& module() const;
  at::Tensor forward(at::Tensor x);
  // What FullyShardedDataParallel wraps (a Sequential root stays one, so auto-wrap applies).
  std::shared_ptr<worker::UnitImpl> root() const;
};

// Builds the model of `spec` with its fixed parameter values and frozen parameters.
Model buildModel(const ModelSpec& spec);
worker::FsdpOptions fsdpOptions(const CaseSpec& c);

}  // namespace fsdp::testing::diff
