#pragma once
// The restore of in-memory snapshots (Snapshotter::restore): the ranks agree, from what every
// node's keeper holds, on the newest step whose every rank some surviving node holds, and each
// rank fetches the pieces it needs from its own node's keeper or, over TCP, from another's.
// Private to libfsdp.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/common/snapshot_wire.hpp"
#include "fsdp/worker/checkpoint.hpp"
#include "fsdp/worker/fsdp.hpp"

namespace torch::optim {
class Optimizer;
}

namespace fsdp::worker {
class Runtime;
}

namespace fsdp::worker::detail {

// A piece a keeper holds: rank `rank` of world `world` at `step`, put in rendezvous round
// `round`; `peer`: a copy of another node's rank.
struct HeldPiece {
  int rank = 0;
  int world = 0;
  std::int64_t step = 0;
  bool peer = false;
  int round = 0;
};

// What one node's keeper holds, as its local rank 0 publishes it in the store:
// {"endpoint": "host:port", "pieces": [[rank, world, step, peer, round], ...]}.
struct NodeHoldings {
  std::string endpoint;  // its keeper's TCP side; "" when unknown
  std::vector<HeldPiece> pieces;
};
std::string holdingsText(const NodeHoldings& holdings);
// The holdings a text describes; malformed entries are left out (every rank reads the same text
// and so leaves out the same).
NodeHoldings parseHoldings(const std::string& text);

// Leaves out the pieces of a trajectory a later round left: a piece is abandoned when some node
// holds a piece of a newer round at its step or before it (that round resumed from before it;
// the steps it redid need not be the same bits, with nondeterministic kernels). A keeper drops
// such pieces of its own at the newer round's put; this covers the other nodes' keepers, so
// that what is left at any step is of one round and a restore never mixes two trajectories.
void dropAbandoned(std::vector<NodeHoldings>& nodes);

// The snapshot to restore: the newest (step, world) whose every rank [0, world) at least one
// node holds; on a tie of steps, `currentWorld` first (no reshard), then the larger world.
// `world` is 0 when there is none; `why` then says why in one line for the log ("" when no
// node holds anything: nothing worth a line). Pure: every rank decides the same from the same.
struct SnapshotChoice {
  std::int64_t step = -1;
  int world = 0;
  std::string why;
};
SnapshotChoice chooseSnapshot(const std::vector<NodeHoldings>& nodes, int currentWorld);

// The nodes (indices into `nodes`) that hold rank `rank` of `world` at `step`, in the order to
// ask them: `self` first, then nodes holding it as their own piece, then peer copies.
std::vector<int> holdersOf(const std::vector<NodeHoldings>& nodes, int self, int rank, int world,
                           std::int64_t step);

// How a restore reaches this node's keeper, and the job's credentials for the others.
struct KeeperLink {
  Runtime& runtime;
  // One request to this node's keeper on its Unix socket; the descriptor of a get's piece into
  // `passed`. Throws Error when the keeper is gone.
  std::function<nlohmann::json(const nlohmann::json& request, snapshot::Fd* passed)> ask;
  std::string token;
  std::chrono::milliseconds timeout;
  int call = 0;  // how many restores this process made before (keys of its own per call)
  // Once the step is chosen: whether this rank's shards and optimizer state hold it already (a
  // survivor of a re-formation whose state lies in that snapshot's memory: nothing to copy).
  std::function<bool(std::int64_t step, int world)> ownStateHolds;
  // This rank's piece of `step` in this world (its fd, `bytes` long) mapped for the state to be
  // restored in place (a new process: no copy); null where it cannot be.
  std::function<std::shared_ptr<char>(int fd, std::uint64_t bytes, std::int64_t step, int world)> mapOwnPiece;
};

struct Restored {
  TrainingProgress progress;
  std::string source;  // "memory" or "peer copy"
};

// Collective (every rank of the job). See Snapshotter::restore.
std::optional<Restored> restoreFromKeepers(const KeeperLink& link, FullyShardedDataParallel& model,
                                           torch::optim::Optimizer* optimizer);

}  // namespace fsdp::worker::detail
