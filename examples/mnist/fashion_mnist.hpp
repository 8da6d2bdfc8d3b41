#pragma once
// Reads the Fashion-MNIST IDX files (plain or .gz) into tensors.

#include <ATen/core/Tensor.h>

#include <string>

namespace fsdp::examples {

struct Dataset {
  at::Tensor images;  // [N, 1, 28, 28] float32, normalised
  at::Tensor labels;  // [N] int64
};

// Loads "<dir>/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]". Throws ConfigError naming
// the path when a file is missing, and Error naming it when a file is malformed.
Dataset loadFashionMnist(const std::string& dir, bool train);

}  // namespace fsdp::examples
