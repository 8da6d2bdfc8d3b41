// Random models and options for the FSDP differential test (see model_gen.hpp).
#include "model_gen.hpp"

#include <ATen/Functions.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <random>
#include <sstream>

namespace fsdp::testing::diff {
namespace {

using torch::nn::AnyModule;

// ---- The custom modules ----------------------------------------------------------------------

class ConvBlockImpl : public torch::nn::Module {
 public:
  ConvBlockImpl(std::int64_t channels, std::int64_t outChannels, std::int64_t side)
      : channels_(channels), side_(side) {
    conv = register_module("conv", torch::nn::Conv2d(
                                       torch::nn::Conv2dOptions(channels, outChannels, 3).padding(1)));
  }
  at::Tensor forward(at::Tensor x) {
    return at::tanh(conv(x.view({x.size(0), channels_, side_, side_}))).flatten(1);
  }
  torch::nn::Conv2d conv{nullptr};

 private:
  std::int64_t channels_, side_;
};
TORCH_MODULE(ConvBlock);

// x + fc2(tanh(fc1(x)))
class ResidualImpl : public torch::nn::Module {
 public:
  explicit ResidualImpl(std::int64_t d) {
    fc1 = register_module("fc1", torch::nn::Linear(d, d));
    fc2 = register_module("fc2", torch::nn::Linear(d, d));
  }
  at::Tensor forward(at::Tensor x) { return x + fc2(at::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Residual);

// Members and a raw parameter of its own: ln(lin(x)) * scale.
class CustomImpl : public torch::nn::Module {
 public:
  CustomImpl(std::int64_t in, std::int64_t out) {
    lin = register_module("lin", torch::nn::Linear(in, out));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({out}).eps(1e-2)));
    scale = register_parameter("scale", at::ones({out}));
  }
  at::Tensor forward(at::Tensor x) { return ln(lin(x)) * scale; }
  torch::nn::Linear lin{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(Custom);

// One fsdp::Unit called twice in one forward: u(tanh(u(x))).
class TwiceImpl : public torch::nn::Module {
 public:
  explicit TwiceImpl(std::int64_t d) { u = register_module("u", worker::Unit(torch::nn::Linear(d, d))); }
  at::Tensor forward(at::Tensor x) { return u(at::tanh(u(x))); }
  worker::Unit u{nullptr};
};
TORCH_MODULE(Twice);

// Token ids made from the first `taken` input features (the raw input, so every rank and the
// reference pick the same ids), embedded and appended to the input.
class EmbedMixImpl : public torch::nn::Module {
 public:
  EmbedMixImpl(std::int64_t vocab, std::int64_t taken, std::int64_t width) : vocab_(vocab), taken_(taken) {
    emb = register_module("emb", torch::nn::Embedding(vocab, width));
  }
  at::Tensor forward(at::Tensor x) {
    const auto ids = x.narrow(1, 0, taken_).add(3).mul(2).floor().clamp(0, vocab_ - 1).to(at::kLong);
    return at::cat({x, emb(ids).flatten(1)}, 1);
  }
  torch::nn::Embedding emb{nullptr};

 private:
  std::int64_t vocab_, taken_;
};
TORCH_MODULE(EmbedMix);

// A custom root: its blocks are members it calls itself.
class PipelineImpl : public torch::nn::Module {
 public:
  PipelineImpl(std::vector<std::pair<std::string, AnyModule>> blocks, std::int64_t out, bool rootParam) {
    for (auto& [name, block] : blocks) {
      register_module(name, block.ptr());
      blocks_.push_back(std::move(block));
    }
    if (rootParam) shift = register_parameter("shift", at::zeros({out}));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& block : blocks_) x = block.forward(x);
    return shift.defined() ? x + shift : x;
  }
  at::Tensor shift;

 private:
  std::vector<AnyModule> blocks_;
};
TORCH_MODULE(Pipeline);

// ---- Building --------------------------------------------------------------------------------

AnyModule buildBlock(const BlockSpec& b) {
  switch (b.kind) {
    case BlockKind::kLinear: return AnyModule(torch::nn::Linear(b.in, b.out));
    case BlockKind::kTanh: return AnyModule(torch::nn::Tanh());
    case BlockKind::kConv: return AnyModule(ConvBlock(b.channels, b.outChannels, b.side));
    // Normalisation over a handful of values is ill-conditioned: with a tiny variance its
    // gradients are huge, and the reduction's summation order (a ring here, a loop in the
    // reference) shows in the last bits of everything upstream. A larger eps bounds 1/sigma.
    case BlockKind::kLayerNorm:
      return AnyModule(torch::nn::LayerNorm(torch::nn::LayerNormOptions({b.in}).eps(1e-2)));
    case BlockKind::kBatchNorm: return AnyModule(torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(b.in).eps(0.1)));
    case BlockKind::kEmbed: return AnyModule(EmbedMix(b.vocab, b.taken, b.width));
    case BlockKind::kDropout: return AnyModule(torch::nn::Dropout(b.dropout));
    case BlockKind::kResidual: return AnyModule(Residual(b.in));
    case BlockKind::kCustom: return AnyModule(Custom(b.in, b.out));
    case BlockKind::kTwice: return AnyModule(Twice(b.in));
    case BlockKind::kShared: return AnyModule(torch::nn::Linear(b.in, b.in));
    case BlockKind::kUnit: {
      torch::nn::Sequential seq;
      for (std::size_t i = 0; i < b.inner.size(); ++i) seq->push_back(std::to_string(i), buildBlock(b.inner[i]));
      return AnyModule(worker::Unit(seq));
    }
  }
  return {};
}

const char* kindName(BlockKind kind) {
  switch (kind) {
    case BlockKind::kLinear: return "lin";
    case BlockKind::kTanh: return "tanh";
    case BlockKind::kConv: return "conv";
    case BlockKind::kLayerNorm: return "ln";
    case BlockKind::kBatchNorm: return "bn";
    case BlockKind::kEmbed: return "embed";
    case BlockKind::kDropout: return "drop";
    case BlockKind::kResidual: return "res";
    case BlockKind::kCustom: return "custom";
    case BlockKind::kUnit: return "unit";
    case BlockKind::kTwice: return "twice";
    case BlockKind::kShared: return "shared";
  }
  return "?";
}

void describeBlock(std::ostringstream& out, const BlockSpec& b) {
  out << kindName(b.kind);
  switch (b.kind) {
    case BlockKind::kLinear:
    case BlockKind::kCustom: out << "(" << b.in << ">" << b.out << ")"; break;
    case BlockKind::kConv: out << "(" << b.channels << "x" << b.side << "x" << b.side << ">" << b.outChannels << ")"; break;
    case BlockKind::kEmbed: out << "(" << b.vocab << "," << b.taken << "x" << b.width << ")"; break;
    case BlockKind::kDropout: out << "(" << b.dropout << ")"; break;
    case BlockKind::kResidual:
    case BlockKind::kTwice:
    case BlockKind::kShared:
    case BlockKind::kLayerNorm:
    case BlockKind::kBatchNorm: out << "(" << b.in << ")"; break;
    case BlockKind::kUnit:
      out << (b.frozenUnit ? "[frozen " : "[");
      for (std::size_t i = 0; i < b.inner.size(); ++i) {
        if (i > 0) out << " ";
        describeBlock(out, b.inner[i]);
      }
      out << "]";
      break;
    case BlockKind::kTanh: break;
  }
}

void fillAndFreeze(torch::nn::Module& model, const ModelSpec& spec) {
  at::NoGradGuard noGrad;
  double k = 0.1;
  std::mt19937_64 rng(spec.freezeSeed);
  std::bernoulli_distribution freeze(spec.freezeProbability);
  const auto named = model.named_parameters();
  for (const auto& item : named) {
    auto p = item.value();
    p.copy_(at::sin(at::arange(p.numel(), at::kFloat).mul(0.37).add(k)).reshape(p.sizes()).mul(0.4));
    k += 0.7;
    const bool head = item.key().starts_with("head.");
    if (!head && freeze(rng)) p.set_requires_grad(false);
  }
}

// ---- Drawing ---------------------------------------------------------------------------------

class Draw {
 public:
  explicit Draw(std::uint64_t seed) : rng_(seed) {}
  int integer(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  template <typename T>
  const T& pick(const std::vector<T>& items) {
    return items[static_cast<std::size_t>(integer(0, static_cast<int>(items.size()) - 1))];
  }
  std::uint64_t next() { return rng_(); }

 private:
  std::mt19937_64 rng_;
};

// One block taking `d` features; returns it with its output width.
BlockSpec drawBlock(Draw& draw, std::int64_t d, bool inUnit, bool exactOnly) {
  std::vector<BlockKind> kinds{BlockKind::kLinear, BlockKind::kLinear, BlockKind::kTanh,
                               BlockKind::kLayerNorm, BlockKind::kBatchNorm, BlockKind::kDropout,
                               BlockKind::kResidual, BlockKind::kCustom};
  // Dropout that draws (one-rank cases) goes where checkpointing recomputes it: inside units.
  if (inUnit && !exactOnly) kinds.insert(kinds.end(), {BlockKind::kDropout, BlockKind::kDropout});
  if (!inUnit) {
    kinds.insert(kinds.end(), {BlockKind::kConv, BlockKind::kUnit, BlockKind::kUnit, BlockKind::kTwice,
                               BlockKind::kShared});
  }
  BlockSpec b;
  b.kind = draw.pick(kinds);
  b.in = d;
  b.out = d;
  switch (b.kind) {
    case BlockKind::kLinear:
    case BlockKind::kCustom: b.out = draw.integer(3, 13); break;
    case BlockKind::kDropout: b.dropout = exactOnly ? 0.0 : 0.4; break;
    case BlockKind::kConv: {
      // Reinterpret the features as [C, s, s]: only where d factors so.
      b.side = d % 9 == 0 ? 3 : (d % 4 == 0 ? 2 : 1);
      b.channels = d / (b.side * b.side);
      b.outChannels = draw.integer(1, 3);
      b.out = b.outChannels * b.side * b.side;
      break;
    }
    case BlockKind::kUnit: {
      const int n = draw.integer(1, 3);
      std::int64_t w = d;
      for (int i = 0; i < n; ++i) {
        b.inner.push_back(drawBlock(draw, w, /*inUnit=*/true, exactOnly));
        w = b.inner.back().out;
      }
      b.out = w;
      b.frozenUnit = draw.chance(0.2);
      break;
    }
    default: break;
  }
  return b;
}

}  // namespace

// ---- Public ------------------------------------------------------------------------------------

torch::nn::Module& Model::module() const { return sequential ? *sequential.ptr() : *custom.ptr(); }

at::Tensor Model::forward(at::Tensor x) { return sequential ? sequential->forward(x) : custom.forward(x); }

std::shared_ptr<worker::UnitImpl> Model::root() const {
  return sequential ? std::make_shared<worker::UnitImpl>(sequential)
                    : std::make_shared<worker::UnitImpl>(custom);
}

Model buildModel(const ModelSpec& spec) {
  std::vector<std::pair<std::string, AnyModule>> blocks;
  for (std::size_t i = 0; i < spec.blocks.size(); ++i) {
    const std::string name = "b" + std::to_string(i);
    blocks.emplace_back(name, buildBlock(spec.blocks[i]));
    if (spec.blocks[i].kind == BlockKind::kShared) {  // the same module again
      blocks.emplace_back(name + "_act", AnyModule(torch::nn::Tanh()));
      blocks.emplace_back(name + "_again", blocks[blocks.size() - 2].second);
    }
  }
  const std::int64_t last = spec.blocks.empty() ? spec.in : spec.blocks.back().out;
  blocks.emplace_back("head", AnyModule(torch::nn::Linear(last, spec.out)));
  Model model;
  if (spec.sequentialRoot) {
    model.sequential = torch::nn::Sequential();
    for (auto& [name, block] : blocks) model.sequential->push_back(name, block);
  } else {
    model.custom = AnyModule(Pipeline(std::move(blocks), spec.out, spec.rootParam));
  }
  fillAndFreeze(model.module(), spec);
  // Whole frozen units.
  for (std::size_t i = 0; i < spec.blocks.size(); ++i) {
    if (spec.blocks[i].kind != BlockKind::kUnit || !spec.blocks[i].frozenUnit) continue;
    for (auto& p : model.module().named_children()["b" + std::to_string(i)]->parameters()) {
      p.set_requires_grad(false);
    }
  }
  return model;
}

bool CaseSpec::dropout() const {
  const std::function<bool(const std::vector<BlockSpec>&)> any = [&](const std::vector<BlockSpec>& blocks) {
    for (const auto& b : blocks) {
      if ((b.kind == BlockKind::kDropout && b.dropout > 0) || any(b.inner)) return true;
    }
    return false;
  };
  return any(model.blocks);
}

CaseSpec drawCase(std::uint64_t seed, int maxWorld) {
  Draw draw(seed);
  CaseSpec c;
  c.seed = seed;
  c.world = draw.integer(1, maxWorld);
  // Dropout with p > 0 draws from the process-wide generator, which ranks as threads share:
  // such cases run on one rank and must equal the plain module with the same seed.
  const bool exactOnly = c.world > 1 || draw.chance(0.6);
  auto& m = c.model;
  m.in = draw.pick(std::vector<std::int64_t>{4, 6, 8, 9, 12});
  m.out = draw.integer(2, 5);
  m.sequentialRoot = draw.chance(0.7);
  m.rootParam = !m.sequentialRoot && draw.chance(0.5);
  std::int64_t d = m.in;
  if (draw.chance(0.25)) {
    BlockSpec e;
    e.kind = BlockKind::kEmbed;
    e.in = d;
    e.vocab = draw.integer(3, 9);
    e.taken = draw.integer(1, 2);
    e.width = draw.integer(2, 4);
    e.out = d + e.taken * e.width;
    m.blocks.push_back(e);
    d = e.out;
  }
  const int n = draw.integer(2, 6);
  for (int i = 0; i < n; ++i) {
    m.blocks.push_back(drawBlock(draw, d, /*inUnit=*/false, exactOnly));
    d = m.blocks.back().out;
  }
  m.freezeProbability = draw.pick(std::vector<double>{0.0, 0.0, 0.2, 0.5});
  m.freezeSeed = draw.next();

  using worker::ShardingStrategy;
  c.strategy = draw.pick(std::vector<ShardingStrategy>{
      ShardingStrategy::kFullShard, ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
      ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard});
  if (c.strategy == ShardingStrategy::kHybridShard) {
    if (c.world == 4) {
      c.hybridLocal = 2;
    } else if (c.world == 2) {
      c.hybridLocal = draw.integer(1, 2);
    } else {
      c.hybridLocal = c.world;  // one node: HYBRID_SHARD is FULL_SHARD with a replica of one
    }
  }
  if (m.sequentialRoot) {
    c.autoWrap = draw.pick(std::vector<AutoWrapKind>{AutoWrapKind::kNone, AutoWrapKind::kMinParams,
                                                     AutoWrapKind::kMinParams, AutoWrapKind::kByTypeName});
    c.minParams = draw.pick(std::vector<std::int64_t>{1, 30, 100});
    // Types that hold no other type of the list (a pick inside an unpicked module would be
    // refused: FSDP cannot wrap the members of a custom module).
    c.typeNames = {draw.pick(std::vector<std::string>{"Residual", "Custom", "ConvBlock", "Linear"})};
    if (c.typeNames.front() == "Linear") {
      for (const auto& b : m.blocks) {
        if (b.kind == BlockKind::kResidual || b.kind == BlockKind::kCustom || b.kind == BlockKind::kUnit ||
            b.kind == BlockKind::kTwice) {
          c.typeNames = {"Linear", "Residual", "Custom", "Twice"};
        }
      }
    }
  }
  c.backwardPrefetch = draw.pick(std::vector<worker::BackwardPrefetch>{
      worker::BackwardPrefetch::kNone, worker::BackwardPrefetch::kPre, worker::BackwardPrefetch::kPost});
  c.forwardPrefetch = draw.chance(0.3);
  c.limitAllGathers = draw.integer(1, 2);
  c.checkpointing = draw.chance(exactOnly ? 0.3 : 0.6);
  c.bf16 = draw.chance(0.12);
  // A bf16 sum of more than two values depends on its order by more than any useful
  // tolerance: past two ranks per group, bf16 cases reduce in fp32 (the usual recipe).
  c.bf16Reduce = c.bf16 && c.world <= 2;
  c.syncModuleStates = draw.chance(0.2);
  c.microBatches = draw.chance(0.25) ? 2 : 1;
  c.clip = draw.chance(0.25) ? 0.05 : 0.0;
  // bf16 with Adam is left out: a gradient that cancels exactly (a bias before BatchNorm) is
  // bf16 rounding noise, which Adam scales to a full step; no tolerance tells that from a bug.
  c.optimizer = c.bf16 || draw.chance(0.7) ? OptimizerKind::kSgd : OptimizerKind::kAdam;
  // Every micro-batch of every rank holds at least two examples (BatchNorm needs two);
  // ranks may hold different counts.
  for (int r = 0; r < c.world; ++r) c.localBatch.push_back(2 * c.microBatches + draw.integer(0, 2));
  return c;
}

worker::FsdpOptions fsdpOptions(const CaseSpec& c) {
  worker::FsdpOptions o;
  o.strategy = c.strategy;
  if (c.autoWrap == AutoWrapKind::kMinParams) o.autoWrap = worker::AutoWrapPolicy::minParams(c.minParams);
  if (c.autoWrap == AutoWrapKind::kByTypeName) o.autoWrap = worker::AutoWrapPolicy::byTypeName(c.typeNames);
  o.backwardPrefetch = c.backwardPrefetch;
  o.forwardPrefetch = c.forwardPrefetch;
  o.limitAllGathers = c.limitAllGathers;
  o.activationCheckpointing = c.checkpointing;
  if (c.bf16) o.mixedPrecision = {at::kBFloat16, c.bf16Reduce ? at::kBFloat16 : at::kFloat, at::kBFloat16};
  o.syncModuleStates = c.syncModuleStates;
  return o;
}

std::string CaseSpec::describe() const {
  std::ostringstream out;
  out << "seed=" << seed << " model=" << (model.sequentialRoot ? "Sequential{" : "Custom{") << model.in << ": ";
  for (const auto& b : model.blocks) {
    describeBlock(out, b);
    out << " ";
  }
  out << "head>" << model.out << (model.rootParam ? " +shift" : "") << "}";
  if (model.freezeProbability > 0) out << " frozen~" << model.freezeProbability;
  out << " | " << worker::toString(strategy) << " world=" << world;
  if (strategy == worker::ShardingStrategy::kHybridShard) out << "(" << hybridLocal << "x" << world / hybridLocal << ")";
  if (autoWrap == AutoWrapKind::kMinParams) out << " wrap>=" << minParams;
  if (autoWrap == AutoWrapKind::kByTypeName) {
    out << " wrap=";
    for (const auto& t : typeNames) out << t << (&t == &typeNames.back() ? "" : ",");
  }
  const char* prefetch[] = {"none", "pre", "post"};
  out << " bwd_prefetch=" << prefetch[static_cast<int>(backwardPrefetch)];
  if (forwardPrefetch) out << " fwd_prefetch";
  out << " limit=" << limitAllGathers;
  if (checkpointing) out << " checkpointing";
  if (bf16) out << (bf16Reduce ? " bf16" : " bf16(reduce fp32)");
  if (syncModuleStates) out << " sync_module_states";
  if (microBatches > 1) out << " no_sync x" << microBatches;
  if (clip > 0) out << " clip=" << clip;
  out << (optimizer == OptimizerKind::kSgd ? " sgd" : " adam") << " steps=" << steps << " batch=";
  for (std::size_t r = 0; r < localBatch.size(); ++r) out << (r > 0 ? "+" : "") << localBatch[r];
  return out.str();
}

}  // namespace fsdp::testing::diff
