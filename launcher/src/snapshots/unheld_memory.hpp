#pragma once
// The snapshot keeper's hold on memory its table let go (keeper.cpp). A rank's piece that a newer
// put dropped is the buffer its worker writes next; its descriptor stays here, so that the
// worker's death does not free that memory on a core the ranks still at work share (perf of a
// killed DeepNet rank, 2 ranks on 2 cores: 50-75 ms of shmem pages freed in its exit), and that
// rank's replacement takes it back to write its first snapshot into instead of a piece the table
// holds. One per rank and world size, the newest let go. Not counted against
// --snapshot_memory_limit: while its worker lives, the memory is the worker's anyway.
// Guarded by the keeper's mutex.

#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>

#include <cerrno>
#include <cstdint>
#include <list>
#include <string>
#include <utility>

#include "fsdp/common/lifeline.hpp"
#include "fsdp/common/snapshot_wire.hpp"

namespace fsdp::launcher::detail {

class UnheldMemory {
 public:
  // What a piece was: its rank, world size, step, bytes; and the process that put it.
  struct Was {
    int rank = 0;
    int world = 0;
    std::int64_t step = 0;
    std::uint64_t bytes = 0;
    pid_t owner = 0;
  };

  // The memory of a dropped piece.
  void keep(snapshot::Fd fd, const Was& was) {
    struct stat st {};
    if (was.owner <= 0 || !fd || ::fstat(fd.get(), &st) != 0) return;
    forget([&](const Entry& e) { return e.was.rank == was.rank && e.was.world == was.world; });
    entries_.push_back({std::move(fd), was, st.st_dev, st.st_ino});
    bytes_ += was.bytes;
  }

  // Lets go of what another world size's ranks left (the world re-formed: none of them writes
  // for it again).
  void keepOnly(int world) {
    forget([world](const Entry& e) { return e.was.world != world; });
  }

  // The memory `rank` of `world` left, for its replacement to write into, once the process that
  // wrote it has exited, and what its piece was; none while that process may still write it, or
  // where `held(dev, ino)` says a piece of the table lies in it again.
  template <typename Held>
  std::pair<snapshot::Fd, Was> take(int rank, int world, Held&& held) {
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->was.rank != rank || it->was.world != world || !exited(it->was.owner) || held(it->dev, it->ino)) {
        continue;
      }
      std::pair<snapshot::Fd, Was> taken{std::move(it->fd), it->was};
      bytes_ -= it->was.bytes;
      entries_.erase(it);
      return taken;
    }
    return {};
  }

  std::uint64_t bytes() const { return bytes_; }

  // Whether process `pid` writes nothing again: gone, or past the point of no return of its exit
  // (exitingStatus: PF_EXITING, as the lifeline reads a worker's death; a killed worker's memory
  // is torn down for 0.1-0.3 s after that, while its replacement restores). One being killed
  // but not yet there counts as alive.
  static bool exited(pid_t pid) {
    return exitingStatus(pid).has_value() || (::kill(pid, 0) != 0 && errno == ESRCH);
  }

 private:
  struct Entry {
    snapshot::Fd fd;
    Was was;
    dev_t dev = 0;
    ino_t ino = 0;
  };

  template <typename Pred>
  void forget(Pred&& pred) {
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (pred(*it)) {
        bytes_ -= it->was.bytes;
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
  }

  std::list<Entry> entries_;
  std::uint64_t bytes_ = 0;
};

}  // namespace fsdp::launcher::detail
