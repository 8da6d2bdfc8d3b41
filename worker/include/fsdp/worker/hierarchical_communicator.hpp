#pragma once
// The world of several nodes as one communicator: `local` spans this node's ranks (shared
// memory), `cross` spans this local rank on every node (Gloo). Ranks are node-major, as
// fsdprun assigns them: rank = node * local->size() + local->rank().
//
//   reduce-scatter: inside the node (each local rank gets the node's sum of the chunks it will
//                   reduce across), then across nodes;
//   all-gather:     across nodes, then inside the node;
//   all-reduce:     reduce-scatter inside, all-reduce of that chunk across, all-gather inside;
//   broadcast:      across nodes among the root's local rank, then inside every node.
//
// So every byte crosses the network once per local rank's share, and the rest moves through
// shared memory. Uneven sizes are padded to equal chunks on the way. Operations run when
// issued; the Work carries their outcome (the first level's error, naming its rank).

#include <memory>

#include "fsdp/worker/communicator.hpp"

namespace fsdp::worker {

// Throws ConfigError when a level is missing or the two take different devices.
std::unique_ptr<Communicator> makeHierarchicalCommunicator(std::unique_ptr<Communicator> local,
                                                           std::unique_ptr<Communicator> cross);

}  // namespace fsdp::worker
