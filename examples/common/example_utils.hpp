#pragma once
// Small pieces every example prints in its summary line.
#include <span>
#include <string>

#include <CLI/CLI.hpp>

#include "fsdp/common/process.hpp"
#include "fsdp/common/sha256.hpp"
#include "fsdp/worker/fsdp.hpp"
#include "fsdp/worker/runtime.hpp"

namespace fsdp::examples {

using fsdp::peakRssMb;

// SHA-256 over every parameter's name and fp32 bytes, in the model's order, gathered from
// the shards (collective: every rank calls it). Equal hashes mean bit-identical weights.
inline std::string paramsSha256(FullyShardedDataParallel& model) {
  Sha256 hash;
  for (const auto& [name, value] : model->fullParameters()) {
    hash.update(name);
    const auto t = value.to(at::kCPU, at::kFloat).contiguous();
    hash.update(std::as_bytes(
        std::span(static_cast<const float*>(t.data_ptr()), static_cast<std::size_t>(t.numel()))));
  }
  return hash.hexDigest();
}

// HYBRID_SHARD needs its two groups (this node's ranks; this local rank on every node): built
// here when the options ask for it. The caller keeps them alive as long as the model.
inline worker::HybridGroups hybridGroupsFor(Runtime& rt, FsdpOptions& options) {
  worker::HybridGroups groups;
  if (options.strategy == ShardingStrategy::kHybridShard) {
    groups = worker::makeHybridGroups(rt);
    options.shardGroup = groups.shard.get();
    options.replicateGroup = groups.replicate.get();
  }
  return groups;
}

// --checkpoint_dir and --checkpoint_every, spelled alike in every example.
inline void addCheckpointFlags(CLI::App& app, std::string& dir, int& every) {
  app.add_option("--checkpoint_dir,--checkpoint-dir", dir,
                 "Resume from the newest checkpoint here, and save checkpoints here");
  app.add_option("--checkpoint_every,--checkpoint-every", every, "Steps between checkpoints (0 = only the last step)")
      ->check(CLI::NonNegativeNumber);
}

// --snapshot_every: in-memory snapshots held by fsdprun's agent (with --max_restarts > 0).
inline void addSnapshotFlag(CLI::App& app, int& every) {
  app.add_option("--snapshot_every,--snapshot-every", every,
                 "Steps between in-memory snapshots a restart resumes from (0 = off; kept under fsdprun "
                 "--max_restarts N > 0)")
      ->check(CLI::NonNegativeNumber);
}

}  // namespace fsdp::examples
