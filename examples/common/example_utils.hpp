#pragma once
// Small pieces every example prints in its summary line.
#include <sys/resource.h>

#include <span>
#include <string>

#include "fsdp/common/sha256.hpp"
#include "fsdp/worker/fsdp.hpp"

namespace fsdp::examples {

inline double peakRssMb() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

// SHA-256 over every parameter's name and fp32 bytes, in the model's order, gathered from
// the shards (collective: every rank calls it). Equal hashes mean bit-identical weights.
inline std::string paramsSha256(FullyShardedDataParallel& model) {
  Sha256 hash;
  for (const auto& [name, value] : model->fullParameters()) {
    hash.update(name);
    const auto t = value.to(at::kFloat).contiguous();
    hash.update(std::as_bytes(
        std::span(static_cast<const float*>(t.data_ptr()), static_cast<std::size_t>(t.numel()))));
  }
  return hash.hexDigest();
}

}  // namespace fsdp::examples
