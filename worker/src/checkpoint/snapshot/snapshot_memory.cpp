// A rank's snapshot memory in its own process (snapshot_memory.hpp).
#include "snapshot_memory.hpp"

#include <sys/stat.h>

#include <algorithm>

namespace fsdp::worker::detail {

namespace {

// Every state tensor that lies in `b` moves to memory of its own (a copy).
void moveOutOf(const std::shared_ptr<Buffer>& b, FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer,
               const std::string& kind) {
  at::NoGradGuard noGrad;
  forEachStateTensor(model, optimizer, kind, [&](const at::Tensor&, const std::string&, at::Tensor& t) {
    if (inside(b, t)) t.set_(t.clone());
    return true;
  });
}

// Whether nothing holds `b`: the keeper let its step go and no tensor lies in it.
bool unheld(const std::shared_ptr<Buffer>& b) { return b->step < 0 && b.use_count() == 1; }

// A snapshot mapping's pages are not reclaimed by how recently they were used: none of its
// pages is marked used when it goes (6.3+). A worker's exit unmaps ~1.7 GB of them, on a core
// the ranks still at work share: perf of a killed DeepNet rank showed 25-130 ms of its teardown
// moving pages between LRU lists (folio_mark_accessed) without this, none with it.
void adviseNoRecency(void* map, std::uint64_t bytes) { ::madvise(map, bytes, MADV_RANDOM); }

// Whether `b` can take the next snapshot of `bytes`.
bool writableFor(const Buffer& b, std::uint64_t bytes) { return b.bytes == bytes && !b.adopted; }

}  // namespace

bool SnapshotMemory::ownsMemory() const {
  return std::any_of(buffers.begin(), buffers.end(), [](const auto& b) { return !b->adopted; });
}

bool SnapshotMemory::hasFree(std::uint64_t bytes) const {
  return std::any_of(buffers.begin(), buffers.end(),
                     [bytes](const auto& b) { return unheld(b) && writableFor(*b, bytes); });
}

std::shared_ptr<Buffer> SnapshotMemory::bufferFor(std::uint64_t bytes, const std::string& name) {
  for (auto it = buffers.begin(); it != buffers.end();) {
    if (!unheld(*it)) {
      ++it;
    } else if (writableFor(**it, bytes)) {
      return *it;
    } else {
      it = buffers.erase(it);  // another layout (its size will not come back), or a mapped piece
    }
  }
  auto b = std::make_shared<Buffer>();
  b->fd = snapshot::createMemfd(name, bytes);
  snapshot::sealPiece(b->fd.get(), /*writes=*/false);
  void* map = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, b->fd.get(), 0);
  if (map == MAP_FAILED) throwErrno("mapping a snapshot of " + std::to_string(bytes) + " bytes", errno);
  adviseNoRecency(map, bytes);
  b->map = static_cast<char*>(map);
  b->bytes = bytes;
  buffers.push_back(b);
  return b;
}

std::shared_ptr<Buffer> SnapshotMemory::takeBack(snapshot::Fd fd) {
  auto b = std::make_shared<Buffer>();
  b->bytes = snapshot::fileBytes(fd.get());
  void* map = ::mmap(nullptr, b->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (map == MAP_FAILED) return nullptr;
  adviseNoRecency(map, b->bytes);
  b->fd = std::move(fd);
  b->map = static_cast<char*>(map);
  buffers.push_back(b);
  return b;
}

bool SnapshotMemory::liesInLive(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer,
                                const std::string& kind) const {
  std::size_t i = 0;
  return forEachStateTensor(model, optimizer, kind, [&](const at::Tensor&, const std::string&, at::Tensor& t) {
    if (!inside(live, t)) return false;
    return !live->adopted || (i < live->versions.size() && live->versions[i++] == t._version());
  });
}

std::shared_ptr<char> SnapshotMemory::mapPiece(int fd, std::uint64_t bytes, std::int64_t step, int rank, int world) {
  struct stat piece {};
  if (::fstat(fd, &piece) != 0) return nullptr;
  void* map = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  if (map == MAP_FAILED) return nullptr;
  adviseNoRecency(map, bytes);
  auto b = std::make_shared<Buffer>();
  for (const auto& own : buffers) {
    struct stat st {};
    if (!own->adopted && own->fd && ::fstat(own->fd.get(), &st) == 0 && st.st_dev == piece.st_dev &&
        st.st_ino == piece.st_ino) {
      b->pinned = own;
    }
  }
  b->map = static_cast<char*>(map);
  b->bytes = bytes;
  b->step = step;
  b->rank = rank;
  b->world = world;
  b->adopted = true;
  mapped = b;
  return {b, b->map};
}

bool SnapshotMemory::keepMapped(FullyShardedDataParallel& model, torch::optim::Optimizer* optimizer) {
  const auto b = std::move(mapped);
  if (!b || optimizer == nullptr) return false;
  const std::string kind = kindOf(*optimizer);
  if (kind.empty()) return false;
  std::vector<std::int64_t> versions;
  const bool all = forEachStateTensor(model, *optimizer, kind, [&](const at::Tensor&, const std::string&, at::Tensor& t) {
    versions.push_back(t._version());
    return inside(b, t);
  });
  if (!all) {
    moveOutOf(b, model, *optimizer, kind);  // some state was copied (a shard that shares its memory)
    return false;
  }
  b->versions = std::move(versions);
  buffers.push_back(b);
  live = b;
  return true;
}

void SnapshotMemory::moveOut(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer) {
  if (!live) return;
  moveOutOf(live, model, optimizer, optimizerKind(optimizer));
  live.reset();
}

}  // namespace fsdp::worker::detail
