#pragma once
// The Gloo backend: Gloo's own algorithms (ring all-reduce, ring all-gather(v),
// halving-doubling reduce-scatter), on Gloo's TCP transport, connected through our store.

#include <chrono>
#include <memory>
#include <string>

#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/worker/communicator.hpp"

namespace fsdp::worker {

struct GlooOptions {
  int rank = 0;
  int size = 1;
  // Address the Gloo transport listens on; must be reachable by every other rank.
  std::string localAddress = "127.0.0.1";
  // Store keys of this communicator live under this prefix (per round, per group).
  std::string storePrefix = "gloo";
  // Bound on connecting and on every collective.
  std::chrono::milliseconds timeout{300000};
};

// Whether this libfsdp has Gloo. A build against a LibTorch that carries its own copy of Gloo
// (PyTorch's wheels) leaves ours out (cmake/FsdpGloo.cmake); createGlooCommunicator then throws
// ConfigError with glooUnavailableReason(), and fsdp::init() uses shared memory inside a node.
bool glooAvailable();
// Why Gloo is not in this build ("" when it is).
const char* glooUnavailableReason();

// Connects the full mesh (blocks until every rank arrived or the timeout passes; throws
// TimeoutError/NetworkError naming the rank and the store). The store client must outlive
// the call only; the communicator owns its own background thread.
std::unique_ptr<Communicator> createGlooCommunicator(rendezvous::StoreClient& store,
                                                     const GlooOptions& options);

}  // namespace fsdp::worker
