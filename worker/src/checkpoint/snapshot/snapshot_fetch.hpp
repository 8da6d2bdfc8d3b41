#pragma once
// The worker's TCP client of snapshot keepers (snapshot_keeper.hpp has the protocol): the stream
// that pushes this rank's pieces to the next node's keeper, and the remote get that fetches a
// piece from any node's keeper during a restore. Private to libfsdp.

#include <chrono>
#include <cstdint>
#include <string>

#include "fsdp/common/snapshot_wire.hpp"

namespace fsdp::worker::detail {

// A TCP connection to `endpoint` (IPv4 "host:port"), connected within `timeout`, with that
// timeout on every send and receive after. Throws ConfigError on a malformed endpoint,
// NetworkError when it cannot connect.
snapshot::Fd connectKeeper(const std::string& endpoint, std::chrono::milliseconds timeout);

// Sets `timeout` on every send and receive of a socket.
void setSocketTimeouts(int fd, std::chrono::milliseconds timeout);

// What a remote get asks for, and the job's credentials.
struct PieceRequest {
  std::string endpoint;  // the holder's keeper
  std::string runId;
  std::string token;
  int rank = 0;
  int world = 0;
  std::int64_t step = 0;
};

// Fetches a piece from the keeper at `request.endpoint` into a new memfd, sealed against writes
// (then read like a piece of this node's keeper). Throws Error naming the endpoint and the
// piece when the keeper does not hold it, refuses, or the stream fails or stalls past `timeout`.
snapshot::Fd fetchPiece(const PieceRequest& request, std::chrono::milliseconds timeout);

}  // namespace fsdp::worker::detail
