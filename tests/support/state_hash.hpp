#pragma once
// The SHA-256 of a rank's FSDP parameter shards, their Adam state, in parameter order (the
// optimizer's state map follows tensor addresses, which a restart changes), and the module's
// buffers (BatchNorm's running statistics; none in most models): what the training
// programs of the snapshot and hang tests compare across a restore. Header-only: those programs
// link libfsdp alone.

#include <torch/optim/adam.h>

#include <string>
#include <string_view>

#include "fsdp/common/sha256.hpp"
#include "fsdp/worker/fsdp.hpp"
#include "fsdp/worker/torch_compat.hpp"

namespace fsdp::testing {

inline std::string adamStateHash(fsdp::FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer) {
  fsdp::Sha256 hash;
  const auto add = [&](const at::Tensor& t) {
    const auto c = t.detach().to(at::kCPU).contiguous();
    hash.update(std::string_view(static_cast<const char*>(c.data_ptr()), static_cast<std::size_t>(c.nbytes())));
  };
  for (const auto& p : model->parameters()) add(p);
  for (const auto& p : model->parameters()) {
    const auto& states = optimizer.state();
    const auto it = states.find(fsdp::worker::compat::optimizerStateKey(states, p));
    if (it == states.end()) continue;
    const auto& adam = static_cast<const torch::optim::AdamParamState&>(*it->second);
    add(adam.exp_avg());
    add(adam.exp_avg_sq());
  }
  for (const auto& [name, buffer] : model->namedBuffers()) add(buffer);
  return hash.hexDigest();
}

}  // namespace fsdp::testing
