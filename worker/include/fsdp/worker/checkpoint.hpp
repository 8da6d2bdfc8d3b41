#pragma once
// Checkpoints of FSDP training: sharded (every rank writes its own shards; loadable at any
// world size) and full (a {name: tensor} pickle that Python's torch.load reads).
//
// A sharded checkpoint is a directory DIR/step_<8 digits>/ holding
//   rank_<5 digits>.bin   this rank's shards of every parameter and of the optimizer state,
//                         its RNG state (and, rank 0, the module's buffers), back to back
//   metadata.json         global shapes, dtypes, which rank holds which element range at which
//                         byte offset (with a CRC-32 per block), world size, strategy, step,
//                         sampler position, optimizer type and scalars, library version
//   COMMIT                written last: a directory without it does not count
// It is written into DIR/.step_<n>.tmp.r<round>/ (every file fsync'ed), then renamed into
// place (directory fsync'ed): a crash at any point leaves the previous checkpoint the newest
// complete one. The newest K are kept. Loading maps every parameter by name, so the new world
// size (and even the wrapping) may differ; each rank reads only the byte ranges it needs.
//
// Multi-node jobs need DIR on a file system every node sees.
//
// Thread-safety: one Checkpointer per rank, used from the training thread. An asynchronous
// save runs on a thread the Checkpointer owns (joined by wait(), the next save, the destructor).

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "fsdp/worker/data.hpp"
#include "fsdp/worker/fsdp.hpp"

namespace torch::optim {
class Optimizer;
}

namespace fsdp::worker {

class Runtime;

// What a run needs besides weights and optimizer state to continue as if never stopped.
struct TrainingProgress {
  std::int64_t step = 0;      // optimizer steps done
  SamplerPosition position;   // where the data continues
  std::uint64_t seed = 0;
  std::string extraJson = "{}";  // the caller's own state (a JSON object)
  // On load: whether this rank's RNG state came back (same world size); otherwise the caller
  // reseeds.
  bool rngRestored = false;
};

struct CheckpointOptions {
  std::string dir;
  int keep = 3;        // complete checkpoints kept, newest first (0: all)
  bool async = false;  // copy the shards, then write on a background thread
  std::chrono::milliseconds timeout{600000};  // bound on waiting for the other ranks' files
};

class Checkpointer {
 public:
  // Throws ConfigError when `options.dir` cannot be created.
  Checkpointer(Runtime& runtime, CheckpointOptions options);
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Collective. Writes this rank's shards and optimizer state; rank 0 commits once every rank's
  // file is written. `optimizer` may be null (weights only). Throws ConfigError for an optimizer
  // whose state cannot be checkpointed (LBFGS), Error for I/O failures (naming the file).
  // `frozen`: the shards and the optimizer state will never change where they are (they lie in
  // an in-memory snapshot: Snapshotter::frozen()), so an asynchronous save writes them from
  // there on its thread, without copying them on this one.
  void save(FullyShardedDataParallel& model, torch::optim::Optimizer* optimizer,
            const TrainingProgress& progress, bool frozen = false);
  // Collective. Loads the newest complete checkpoint in the directory into the model (and the
  // optimizer); nullopt when there is none. Throws ConfigError naming the file and the problem
  // for a checkpoint that is corrupt or does not fit the model; nothing is changed then.
  std::optional<TrainingProgress> loadLatest(FullyShardedDataParallel& model,
                                             torch::optim::Optimizer* optimizer);
  // Waits until an asynchronous save is committed; rethrows its error.
  void wait();

  const CheckpointOptions& options() const { return options_; }

 private:
  Runtime& runtime_;
  CheckpointOptions options_;
  std::thread writer_;
  std::exception_ptr writerError_;
};

// Collective. The full parameters and buffers, gathered one flat parameter at a time (never the
// whole model on every rank), written by rank 0 to `path` (atomically) as a {name: tensor}
// pickle (torch::pickle_save) that Python's torch.load reads into a state dict.
void saveFullCheckpoint(Runtime& runtime, FullyShardedDataParallel& model, const std::string& path);

// Offline tools (fsdp-ckpt): one process, no job.
// The newest complete checkpoint under `dir` (a step_* directory with COMMIT), if any.
std::optional<std::string> newestCheckpoint(const std::string& dir);
// Reads and checks a checkpoint (every file's size and every block's CRC); a human summary.
// Throws ConfigError naming the file and the problem.
std::string inspectCheckpoint(const std::string& path);
// Writes the full parameters and buffers as a {name: tensor} pickle for torch.load.
void consolidateCheckpoint(const std::string& path, const std::string& outFile);
// Writes a copy laid out for `world` ranks (RNG states are left out: they belong to ranks).
void reshardCheckpoint(const std::string& path, const std::string& outDir, int world);

}  // namespace fsdp::worker

namespace fsdp {
using worker::Checkpointer;
using worker::CheckpointOptions;
using worker::saveFullCheckpoint;
using worker::TrainingProgress;
}  // namespace fsdp
