#pragma once
// In-memory snapshots: after a step, each rank hands a copy of its training state (its
// parameter and optimizer shards, RNG, buffers, data position, step) to its agent, which holds
// it across the worker's death; a copy also goes to the next node's agent. After a restart,
// restore() brings back the newest step that every rank holds, so a failure costs at most the
// step in progress instead of everything since the last disk checkpoint.
//
//   fsdp::Snapshotter snapshots(*rt);                // collective
//   if (auto p = snapshots.restore(model, &optimizer)) step = p->step;  // else: disk, or start
//   for (...) {
//     ... forward, backward ...
//     snapshots.step(model, optimizer);              // instead of optimizer.step()
//     snapshots.save(model, &optimizer, {.step = ++step, .position = next, .seed = seed});
//   }
//
// step() is the optimizer's step: with Adam or AdamW on CPU shards it writes the new
// parameters and optimizer state straight into the memory of the next snapshot (the same
// operations, so the same values), and save() then copies nothing but the RNG and the module's
// buffers. Otherwise save() copies the shards and the state on a background thread while the
// next step computes. Once step() is used, every optimizer step must go through it: the
// parameters then live in memory the agent holds, which optimizer.step() would change in place.
// Without step(): call wait() before anything changes the parameters or the optimizer state
// (the next optimizer.step(), a load).
// Active only under fsdprun with --max_restarts > 0 (its agent keeps snapshots); elsewhere
// every call does nothing. A snapshot the agent cannot hold (--snapshot_memory_limit) turns
// snapshots off for the run with one warning; training goes on.
//
// Thread-safety: one Snapshotter per rank, used from the training thread.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "fsdp/worker/checkpoint.hpp"
#include "fsdp/worker/fsdp.hpp"

namespace torch::optim {
class Optimizer;
}

namespace fsdp::worker {

class Runtime;

struct SnapshotOptions {
  bool peerCopy = true;  // also send each snapshot to the next node's agent (multi-node jobs)
  std::chrono::milliseconds timeout{120000};  // bound on the agents' replies
};

class Snapshotter {
 public:
  // Collective: the ranks agree whether every one of them has an agent that keeps snapshots, and
  // learn where the next node's agent listens.
  explicit Snapshotter(Runtime& runtime, SnapshotOptions options = {});
  ~Snapshotter();
  Snapshotter(const Snapshotter&) = delete;
  Snapshotter& operator=(const Snapshotter&) = delete;

  // Whether snapshots are kept (every rank under an agent that keeps them, none refused yet).
  bool enabled() const;

  // Starts a snapshot of the state after `progress.step`. The RNG is captured now; the shards
  // and the optimizer state are copied on a background thread until wait().
  void save(FullyShardedDataParallel& model, torch::optim::Optimizer* optimizer, const TrainingProgress& progress);
  // Waits for the snapshot in flight (copied and held by the agent).
  void wait();
  // wait(), then the optimizer's step, written into the next snapshot's memory when the
  // optimizer is Adam or AdamW, the shards are on the CPU and snapshots are on (else
  // optimizer.step()).
  void step(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer);
  // Whether the shards and the optimizer state lie in snapshot memory that nothing writes again
  // (after a step() that wrote them there): until the next step() they are the state of the
  // last step, and afterwards they stay that (the next step writes elsewhere). A checkpoint
  // writer may then read them on its own thread (Checkpointer::save's `frozen`).
  bool frozen(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer) const;

  // Collective, as the constructor: after an in-process re-formation (reform.hpp), the ranks of
  // the new round agree again (the new processes construct theirs meanwhile). The next restore()
  // copies nothing of this rank's own state when it lies in the snapshot chosen (the survivor's
  // memory is that snapshot's).
  void rejoin();

  // Collective. Restores the newest step of which every rank's piece is held by some node's
  // agent (a lost node's ranks by the node holding their peer copies), at the current world size
  // if it can, else resharded from the old one. A rank reads a piece from its own node's agent
  // when it holds it, else fetches it over TCP from an agent that does. nullopt, with one line
  // on rank 0 saying why, when there is none (a node lost with the node holding its peer copies),
  // a fetch failed or it does not fit the model; nothing is changed then, on any rank.
  // At the same world size a rank's CPU shards and optimizer state are not copied: they become
  // views of its piece, mapped copy-on-write (frozen() is true after it). A write in place
  // afterwards (an optimizer.step() outside step()) changes this process's pages only, never
  // the piece the agent holds.
  std::optional<TrainingProgress> restore(FullyShardedDataParallel& model, torch::optim::Optimizer* optimizer);
  // After a restore: "memory" (every rank's own piece, from its own node's agent) or "peer copy"
  // (some piece came from a copy: a lost node's, or one fetched from another node).
  const std::string& restoredFrom() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

namespace detail {

// Where stepInto() writes `what` ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq") of
// parameter `param`: an uninitialised tensor of the same size, dtype and device.
using PlaceFn = std::function<at::Tensor(const at::Tensor& param, const char* what)>;

// One step of an Adam or AdamW `optimizer` whose results go to new memory: every parameter with
// a gradient and its state tensors are written into place() by the operations LibTorch's step()
// performs, then set_() to that memory (every holder of them sees it). The same bits as
// optimizer.step(). False, with nothing changed, for another optimizer or a parameter without
// state yet (the first step creates it) or with a sparse or non-contiguous tensor.
bool stepInto(torch::optim::Optimizer& optimizer, const PlaceFn& place);

}  // namespace detail

}  // namespace fsdp::worker

namespace fsdp {
using worker::SnapshotOptions;
using worker::Snapshotter;
}  // namespace fsdp
