#pragma once
// The one place that knows LibTorch version differences (Debian's 1.13 CPU build on our
// machines, newer CUDA builds given through CMAKE_PREFIX_PATH).

#include <torch/version.h>

#define FSDP_TORCH_VERSION (TORCH_VERSION_MAJOR * 10000 + TORCH_VERSION_MINOR * 100)

namespace fsdp::worker::compat {

// LibTorch 2.x ships torch::nn::Module hooks-free as 1.13 does; differences collected here as
// they appear (e.g. c10::Stream APIs, ScalarType names).
inline constexpr bool kTorch2 = TORCH_VERSION_MAJOR >= 2;

}  // namespace fsdp::worker::compat
