#pragma once
// The agent's snapshot keeper: it holds the in-memory snapshots of this node's workers (sealed
// memfds they hand over an abstract Unix socket) across their deaths, and a copy of the next
// node's snapshots that those workers send over TCP (the peer ring), so that a restart resumes
// from the newest step every rank holds instead of the last disk checkpoint.
//
// What it keeps: per rank, the newest 3 local pieces of the current world size and the newest
// 2 peer pieces; a piece of another world size goes when one of the new size arrives, and any
// rank's piece of an older round at or after the step a newer round puts (that round resumed
// from before it: the old piece lies on a trajectory it left) goes at that put. In all,
// at most `memoryLimit` bytes: past it the oldest pieces go first, and a piece that still does
// not fit is refused (the worker stops snapshotting and says so). Everything goes with the
// keeper: its memfds are never named in /dev/shm.
//
// Messages (JSON, one per packet) on the Unix socket:
//   {"op":"put"} + a sealed piece  -> {"ok":true,"held":[steps of that rank still held]}
//                                     | {"ok":false,"error":"..."}
//   {"op":"list"}                  -> {"ok":true,"pieces":[{"rank","world","step","round","bytes","peer"}]}
//   {"op":"get","rank","world","step"} -> {"ok":true,"peer":bool} + the piece | {"ok":false,...}
//   {"op":"recycle","rank","world","before"} -> {"ok":true,"step"} + the rank's oldest local
//                                     piece when its next put would drop it (it holds the
//                                     most it keeps) and it is older than `before`, no longer
//                                     held (a rank that restored `before` reuses its memory)
//                                     | {"ok":false,...} when none
// On TCP, frames of a u32 length (host order, at most 64 KiB) and JSON; a stream may carry
// any number of requests, one after the other:
//   put (a peer copy; "op" may be absent): {"op":"put","run","rank","world","step","bytes","mac"}
//       then the piece's bytes  -> {"ok":true} | {"ok":false,"error":"..."}
//       "mac" is snapshot::peerMac: a keeper stores nothing from a sender outside the job.
//   get (a restoring worker of any node): {"op":"get","run","rank","world","step","mac"}
//       -> {"ok":true,"bytes":N} then the piece's N bytes (its own piece when it holds both it
//          and a peer copy) | {"ok":false,"error":"..."} (not held; the stream goes on)
//       "mac" is snapshot::getMac (a put header cannot pass as a get): a keeper hands nothing
//       to a reader outside the job.
// A request with a wrong run id or MAC, or a malformed one, closes that stream only (one
// warning). A stream silent for 60 s mid-request is closed.
//
// Thread-safety: the keeper runs on its own threads; its public members may be called from any.

#include <atomic>
#include <cstdint>
#include <chrono>
#include <map>
#include <memory>
#include <string>

namespace fsdp::launcher {

struct KeeperOptions {
  std::string runId;
  std::uint64_t memoryLimit = 0;  // bytes held at most, local and peer pieces together
  std::string listenAddress = "127.0.0.1";  // where the peer stream listens (this node's address)
  std::string token;              // the job token (MAC key of peer streams)
};

struct KeeperStats {
  std::uint64_t bytesHeld = 0;
  int piecesHeld = 0;
  int refused = 0;
  // Per global rank of this node's workers: the step of the newest snapshot received, and when.
  struct Newest {
    std::int64_t step = 0;
    std::chrono::system_clock::time_point at;
  };
  std::map<int, Newest> newest;
  // Memory of this node's workers that no held piece lies in, kept for their replacements
  // (keeper.cpp, unheld_memory.hpp): not counted in bytesHeld.
  std::uint64_t bytesUnheld = 0;
};

class SnapshotKeeper {
 public:
  // Binds both sockets and starts serving. Throws Error when it cannot.
  explicit SnapshotKeeper(KeeperOptions options);
  ~SnapshotKeeper();
  SnapshotKeeper(const SnapshotKeeper&) = delete;
  SnapshotKeeper& operator=(const SnapshotKeeper&) = delete;

  // The abstract socket name for FSDPRUN_SNAPSHOT_SOCKET (without the leading NUL).
  const std::string& socketName() const;
  // host:port of the TCP side (peer copies in, remote gets out), for FSDPRUN_SNAPSHOT_PEER.
  std::string peerEndpoint() const;
  KeeperStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Parses a size such as 512M, 4G, 1024 (bytes), 0; throws ConfigError naming `flag`.
std::uint64_t parseByteSize(const std::string& text, const std::string& flag);

}  // namespace fsdp::launcher
