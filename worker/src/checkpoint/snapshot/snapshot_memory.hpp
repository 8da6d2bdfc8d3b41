#pragma once
// A rank's snapshot memory in its own process (Snapshotter's, snapshot.cpp): the buffers it
// writes its snapshots into, the one its shards and optimizer state lie in, and the piece a
// restore maps for them to lie in without a copy. Private to libfsdp.

#include <sys/mman.h>

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_internal.hpp"
#include "fsdp/common/snapshot_wire.hpp"

namespace fsdp::worker::detail {

// A piece's memory in this process: mapped once, written again once its keeper let it go and no
// live tensor lies in it (step() puts the parameters and the optimizer state in one).
struct Buffer {
  snapshot::Fd fd;
  char* map = nullptr;
  std::uint64_t bytes = 0;
  std::int64_t step = -1;  // the snapshot it holds for the keeper; -1: none
  int rank = -1;           // ... of this rank of this world (a re-formation may move the rank)
  int world = 0;
  // A layout made by step(): the header's reserved bytes and the small blocks' region at the
  // start of the data; 0: a layout write() made.
  std::uint64_t headerReserve = 0;
  std::uint64_t smallBytes = 0;
  // A piece a restore mapped copy-on-write for the state to lie in (mapPiece): never written as
  // a snapshot (its writes stay in this process); and the state's version counters then, which
  // an in-place change (an optimizer.step() outside step()) moves.
  bool adopted = false;
  std::vector<std::int64_t> versions;
  // A mapped piece that is this process's own snapshot (a survivor's): its buffer on the same
  // memfd, not written again while this maps it (a private mapping's unwritten pages would show
  // those writes).
  std::shared_ptr<Buffer> pinned;
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (map != nullptr) ::munmap(map, bytes);
  }
};

// The optimizer's kind as a checkpoint names it; "" for one whose state cannot be saved.
inline std::string kindOf(const torch::optim::Optimizer& optimizer) {
  try {
    return optimizerKind(optimizer);
  } catch (const ConfigError&) {
    return "";
  }
}

inline bool inside(const std::shared_ptr<Buffer>& b, const at::Tensor& t) {
  const auto* p = static_cast<const char*>(t.data_ptr());
  return b && p >= b->map && p < b->map + b->bytes;
}

// Calls fn(shard, what, tensor) for every flat parameter's shard ("param") and each of its
// optimizer state tensors (by name), until fn returns false. The tensors are the live ones
// (set_() on them moves the state).
template <typename Fn>
bool forEachStateTensor(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer, const std::string& kind,
                        Fn&& fn) {
  for (const auto& flat : model->shardLayout().flats) {
    at::Tensor shard = flat.shard;
    if (!fn(flat.shard, std::string("param"), shard)) return false;
    if (auto state = readState(optimizer, kind, flat.shard)) {
      for (auto& [name, t] : state->tensors) {
        if (!fn(flat.shard, name, t)) return false;
      }
    }
  }
  return true;
}

// Used by the Snapshotter's background thread only (and by wait()'s caller after). A buffer is
// free when the keeper no longer holds it and nothing else refers to it (use_count() == 1).
struct SnapshotMemory {
  std::list<std::shared_ptr<Buffer>> buffers;
  std::shared_ptr<Buffer> live;    // where step() or a restore put the shards and the optimizer state
  std::shared_ptr<Buffer> mapped;  // during a restore: the piece mapPiece() mapped

  // Whether this process wrote snapshot memory of its own (else it holds mapped pieces at most).
  bool ownsMemory() const;
  // Whether bufferFor(bytes) would find a free buffer rather than make one.
  bool hasFree(std::uint64_t bytes) const;
  // A free buffer of `bytes`, or a new one named `name` (mapped and faulted in once, its size sealed).
  std::shared_ptr<Buffer> bufferFor(std::uint64_t bytes, const std::string& name);
  // A piece the keeper handed back for reuse, mapped writable and kept; null where it cannot be
  // (sealed against writes).
  std::shared_ptr<Buffer> takeBack(snapshot::Fd fd);
  // Whether every shard and optimizer state tensor lies in `live`, unchanged since a restore put
  // it there when `live` is a mapped piece.
  bool liesInLive(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer, const std::string& kind) const;
  // A restore's own piece (of `rank` of `world` at `step`) mapped copy-on-write: the state
  // restored into it is not copied, and what writes it in place later (an optimizer.step()
  // outside step()) changes this process's pages, never the keeper's piece. Null when it cannot
  // be: then the restore copies.
  std::shared_ptr<char> mapPiece(int fd, std::uint64_t bytes, std::int64_t step, int rank, int world);
  // After a restore: the mapped piece becomes `live` (true) when every state tensor lies in it,
  // as a survivor's lies in its last snapshot, with their versions now; else what lies in it
  // moves out, so that the piece is not kept mapped for the life of the process.
  bool keepMapped(FullyShardedDataParallel& model, torch::optim::Optimizer* optimizer);
  // Every tensor that lies in `live` moves to memory of its own (once; the next optimizer step
  // then changes nothing the agent holds).
  void moveOut(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer);
};

}  // namespace fsdp::worker::detail
