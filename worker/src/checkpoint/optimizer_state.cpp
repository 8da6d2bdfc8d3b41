// Optimizer state per flat parameter shard: reading LibTorch optimizers' per-parameter state
// (Adam, AdamW, SGD, RMSprop, Adagrad) into named tensors and scalars, and writing it back.
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "checkpoint_internal.hpp"
#include "fsdp/worker/torch_compat.hpp"

namespace fsdp::worker::detail {

std::string optimizerKind(const torch::optim::Optimizer& o) {
  if (dynamic_cast<const torch::optim::AdamW*>(&o)) return "adamw";
  if (dynamic_cast<const torch::optim::Adam*>(&o)) return "adam";
  if (dynamic_cast<const torch::optim::SGD*>(&o)) return "sgd";
  if (dynamic_cast<const torch::optim::RMSprop*>(&o)) return "rmsprop";
  if (dynamic_cast<const torch::optim::Adagrad*>(&o)) return "adagrad";
  throw ConfigError("checkpoint: the state of this optimizer cannot be saved (Adam, AdamW, SGD, "
                    "RMSprop and Adagrad can; LBFGS keeps history that does not shard)");
}

std::optional<OptimizerState> readState(torch::optim::Optimizer& o, const std::string& kind,
                                        const at::Tensor& param) {
  auto& states = o.state();
  const auto it = states.find(compat::optimizerStateKey(states, param));
  if (it == states.end()) return std::nullopt;
  OptimizerState out;
  const auto put = [&out](const char* name, const at::Tensor& t) {
    if (t.defined()) out.tensors[name] = t;
  };
  // Adam's and AdamW's states are unrelated types with the same fields.
  const auto adamLike = [&](const auto& s) {
    out.scalars["step"] = s.step();
    put("exp_avg", s.exp_avg());
    put("exp_avg_sq", s.exp_avg_sq());
    put("max_exp_avg_sq", s.max_exp_avg_sq());
  };
  if (kind == "adam") {
    adamLike(static_cast<const torch::optim::AdamParamState&>(*it->second));
  } else if (kind == "adamw") {
    adamLike(static_cast<const torch::optim::AdamWParamState&>(*it->second));
  } else if (kind == "sgd") {
    put("momentum_buffer", static_cast<const torch::optim::SGDParamState&>(*it->second).momentum_buffer());
  } else if (kind == "rmsprop") {
    const auto& s = static_cast<const torch::optim::RMSpropParamState&>(*it->second);
    out.scalars["step"] = s.step();
    put("square_avg", s.square_avg());
    put("momentum_buffer", s.momentum_buffer());
    put("grad_avg", s.grad_avg());
  } else if (kind == "adagrad") {
    const auto& s = static_cast<const torch::optim::AdagradParamState&>(*it->second);
    out.scalars["step"] = s.step();
    put("sum", s.sum());
  }
  return out;
}

void writeState(torch::optim::Optimizer& o, const std::string& kind, const at::Tensor& param,
                const OptimizerState& st) {
  const auto get = [&st](const char* name) {
    const auto it = st.tensors.find(name);
    return it == st.tensors.end() ? at::Tensor() : it->second;
  };
  const auto scalar = [&st](const char* name) {
    const auto it = st.scalars.find(name);
    return it == st.scalars.end() ? 0 : it->second;
  };
  std::unique_ptr<torch::optim::OptimizerParamState> state;
  const auto adamLike = [&](auto s) {
    s->step(scalar("step")).exp_avg(get("exp_avg")).exp_avg_sq(get("exp_avg_sq"));
    if (get("max_exp_avg_sq").defined()) s->max_exp_avg_sq(get("max_exp_avg_sq"));
    state = std::move(s);
  };
  if (kind == "adam") {
    adamLike(std::make_unique<torch::optim::AdamParamState>());
  } else if (kind == "adamw") {
    adamLike(std::make_unique<torch::optim::AdamWParamState>());
  } else if (kind == "sgd") {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(get("momentum_buffer"));
    state = std::move(s);
  } else if (kind == "rmsprop") {
    auto s = std::make_unique<torch::optim::RMSpropParamState>();
    s->step(scalar("step")).square_avg(get("square_avg"));
    if (get("momentum_buffer").defined()) s->momentum_buffer(get("momentum_buffer"));
    if (get("grad_avg").defined()) s->grad_avg(get("grad_avg"));
    state = std::move(s);
  } else if (kind == "adagrad") {
    auto s = std::make_unique<torch::optim::AdagradParamState>();
    s->step(scalar("step")).sum(get("sum"));
    state = std::move(s);
  } else {
    throw ConfigError("checkpoint: unknown optimizer kind '" + kind + "'");
  }
  o.state()[compat::optimizerStateKey(o.state(), param)] = std::move(state);
}

std::vector<std::string> optimizerStateNames(const Manifest& m) {
  if (m.optimizerKind.empty()) return {};
  return m.meta["optimizer"].at("state").get<std::vector<std::string>>();
}

}  // namespace fsdp::worker::detail
