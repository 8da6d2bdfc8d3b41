// The flight recorder ring's memory, its single writer and its readers (flight_ring.hpp).
#include "fsdp/common/flight_ring.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <ctime>
#include <new>
#include <utility>

#include "fsdp/common/error.hpp"

namespace fsdp::flight {
namespace {

template <std::size_t N>
void copyText(char (&to)[N], std::string_view from) {
  const std::size_t n = std::min(from.size(), N - 1);
  if (n > 0) std::memcpy(to, from.data(), n);  // an empty view may hold no pointer at all
  std::memset(to + n, 0, N - n);
}

template <std::size_t N>
std::string readText(const char (&from)[N]) {
  return std::string(from, strnlen(from, N));
}

}  // namespace

const char* opName(Op op) {
  switch (op) {
    case Op::kAllReduce: return "all_reduce";
    case Op::kAllGather: return "all_gather";
    case Op::kReduceScatter: return "reduce_scatter";
    case Op::kBroadcast: return "broadcast";
    case Op::kBarrier: return "barrier";
    case Op::kWait: return "wait";
    case Op::kNone: break;
  }
  return "unknown";
}

std::int64_t nowNs() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

std::size_t ringBytes(std::uint32_t capacity) { return sizeof(Header) + std::size_t{capacity} * sizeof(Slot); }

RingMemory RingMemory::create(std::uint32_t capacity) {
  const int fd = ::memfd_create("fsdprun-flight", MFD_CLOEXEC);
  if (fd < 0) throwErrno("memfd_create for a worker's flight recorder", errno);
  const std::size_t bytes = ringBytes(capacity);
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int e = errno;
    ::close(fd);
    throwErrno("sizing a worker's flight recorder", e);
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int e = errno;
    ::close(fd);
    throwErrno("mapping a worker's flight recorder", e);
  }
  RingMemory ring(fd, base, bytes, capacity);
  auto* h = new (base) Header{};  // the memfd is zeroed; this only gives the atomics a lifetime
  h->magic = kMagic;
  h->version = kVersion;
  h->capacity = capacity;
  h->slotBytes = sizeof(Slot);
  h->rank = -1;
  return ring;
}

RingMemory RingMemory::anonymous(std::uint32_t capacity) {
  const std::size_t bytes = ringBytes(capacity);
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) throwErrno("mapping a private flight recorder", errno);
  auto* h = new (base) Header{};
  h->magic = kMagic;
  h->version = kVersion;
  h->capacity = capacity;
  h->slotBytes = sizeof(Slot);
  h->rank = -1;
  return RingMemory(-1, base, bytes, capacity);
}

std::optional<RingMemory> RingMemory::attach(int fd, std::string* why) {
  // Only the agent's memfd is touched: a program that closed it (a wrapper's close_fds) may have
  // reused the number for something of its own by now.
  char target[256] = {0};
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
  if (n <= 0 || std::string_view(target, static_cast<std::size_t>(n)).find("memfd:fsdprun-flight") == std::string_view::npos) {
    if (why) *why = "fd " + std::to_string(fd) + " is not the agent's flight recorder (closed before this program started?)";
    return std::nullopt;
  }
  const auto fail = [&](const std::string& text) -> std::optional<RingMemory> {
    if (why) *why = text;
    ::close(fd);
    return std::nullopt;
  };
  const off_t size = ::lseek(fd, 0, SEEK_END);
  if (size < static_cast<off_t>(sizeof(Header))) {
    return fail("the flight recorder fd " + std::to_string(fd) + " is not a ring (" + std::to_string(size) + " bytes)");
  }
  void* base = ::mmap(nullptr, static_cast<std::size_t>(size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return fail("cannot map the flight recorder fd " + std::to_string(fd) + ": " + std::strerror(errno));
  const auto* h = static_cast<const Header*>(base);
  if (h->magic != kMagic || h->version != kVersion || h->slotBytes != sizeof(Slot) ||
      ringBytes(h->capacity) != static_cast<std::size_t>(size)) {
    ::munmap(base, static_cast<std::size_t>(size));
    return fail("the flight recorder fd " + std::to_string(fd) + " holds no ring of version " + std::to_string(kVersion));
  }
  return RingMemory(fd, base, static_cast<std::size_t>(size), h->capacity);
}

RingMemory::RingMemory(RingMemory&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      base_(std::exchange(other.base_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      capacity_(std::exchange(other.capacity_, 0)) {}

RingMemory& RingMemory::operator=(RingMemory&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = std::exchange(other.fd_, -1);
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

RingMemory::~RingMemory() { release(); }

void RingMemory::release() noexcept {
  if (base_ != nullptr) ::munmap(base_, bytes_);
  if (fd_ >= 0) ::close(fd_);
  base_ = nullptr;
  fd_ = -1;
}

Slot& RingMemory::slot(std::uint64_t index) const {
  auto* first = reinterpret_cast<Slot*>(static_cast<char*>(base_) + sizeof(Header));
  return first[index % capacity_];
}

Reading RingMemory::read(std::size_t last) const {
  Reading r;
  if (base_ == nullptr) {
    r.error = "no ring";
    return r;
  }
  const Header& h = header();
  // The header was written by the agent and only the counters below by the worker: a header
  // that changed shape means the memory was overwritten (a wild write in the worker).
  if (h.magic != kMagic || h.version != kVersion || h.capacity != capacity_ || h.slotBytes != sizeof(Slot)) {
    r.error = "the flight recorder ring is corrupt (header overwritten: magic " + std::to_string(h.magic) +
              ", version " + std::to_string(h.version) + ", capacity " + std::to_string(h.capacity) + ")";
    return r;
  }
  r.attachedNs = h.attachedNs.load(std::memory_order_acquire);
  r.attached = r.attachedNs != 0;
  r.rank = h.rank;
  r.pid = h.pid.load(std::memory_order_relaxed);
  r.issued = h.issued.load(std::memory_order_acquire);
  r.lastCompletedNs = h.lastCompletedNs.load(std::memory_order_relaxed);
  r.progress.count = h.progressCount.load(std::memory_order_relaxed);
  r.progress.step = h.progressStep.load(std::memory_order_relaxed);
  r.progress.lastNs = h.progressNs.load(std::memory_order_relaxed);
  r.progress.longestGapNs = h.longestGapNs.load(std::memory_order_relaxed);
  r.progress.what = readText(h.progressWhat);
  r.progress.busySinceNs = h.busySinceNs.load(std::memory_order_relaxed);
  if (r.progress.busySinceNs != 0) r.progress.busyWhat = readText(h.busyWhat);
  auto& t = r.timing;
  t.steps = h.steps.load(std::memory_order_acquire);
  t.stepNs = h.stepNs.load(std::memory_order_relaxed);
  t.waitNs = h.waitNs.load(std::memory_order_relaxed);
  t.dataNs = h.dataNs.load(std::memory_order_relaxed);
  t.lastStepNs = h.lastStepNs.load(std::memory_order_relaxed);
  t.lastWaitNs = h.lastWaitNs.load(std::memory_order_relaxed);
  t.lastDataNs = h.lastDataNs.load(std::memory_order_relaxed);
  t.bytes = h.bytes.load(std::memory_order_relaxed);
  t.samples = h.samples.load(std::memory_order_relaxed);
  t.tokens = h.tokens.load(std::memory_order_relaxed);
  t.lastSamples = h.lastSamples.load(std::memory_order_relaxed);
  t.lastTokens = h.lastTokens.load(std::memory_order_relaxed);
  t.loss = h.loss.load(std::memory_order_relaxed);
  t.straggler = h.straggler.load(std::memory_order_relaxed);
  const std::uint64_t n = std::min<std::uint64_t>({r.issued, capacity_, last});
  for (std::uint64_t index = r.issued - n; index < r.issued; ++index) {
    const Slot& s = slot(index);
    const std::uint64_t before = s.generation.load(std::memory_order_acquire);
    if (before != 2 * index + 2) continue;  // being written, or reused for a newer index
    Record rec;
    rec.index = index;
    rec.seq = s.seq;
    rec.count = s.count;
    rec.issuedNs = s.issuedNs;
    rec.op = s.op;
    rec.groupSize = static_cast<int>(std::min<std::uint32_t>(s.groupSize, 1u << 24));
    rec.groupRank = static_cast<int>(std::min<std::uint32_t>(s.groupRank, 1u << 24));
    rec.dtype = readText(s.dtype);
    rec.group = readText(s.group);
    rec.tag = readText(s.tag);
    rec.startedNs = s.startedNs.load(std::memory_order_relaxed);
    rec.completedNs = s.completedNs.load(std::memory_order_relaxed);
    rec.state = static_cast<SlotState>(s.state.load(std::memory_order_acquire));
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s.generation.load(std::memory_order_relaxed) != before) continue;  // overwritten meanwhile
    if (rec.state > SlotState::kFailed) rec.state = SlotState::kIssued;
    r.records.push_back(std::move(rec));
  }
  return r;
}

void Writer::attach(int rank) {
  Header& h = ring_.header();
  h.rank = rank;
  h.loss.store(std::numeric_limits<double>::quiet_NaN(), std::memory_order_relaxed);
  h.pid.store(::getpid(), std::memory_order_relaxed);
  h.attachedNs.store(nowNs(), std::memory_order_release);
}

std::uint64_t Writer::issue(const Issue& what, bool started) {
  Header& h = ring_.header();
  const std::uint64_t index = h.issued.load(std::memory_order_relaxed);
  Slot& s = ring_.slot(index);
  s.generation.store(2 * index + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  const std::int64_t now = nowNs();
  s.seq = what.seq;
  s.count = what.count;
  s.issuedNs = now;
  s.startedNs.store(started ? now : 0, std::memory_order_relaxed);
  s.completedNs.store(0, std::memory_order_relaxed);
  s.state.store(static_cast<std::uint8_t>(SlotState::kIssued), std::memory_order_relaxed);
  s.op = what.op;
  s.groupSize = static_cast<std::uint32_t>(std::max(what.groupSize, 0));
  s.groupRank = static_cast<std::uint32_t>(std::max(what.groupRank, 0));
  copyText(s.dtype, what.dtype);
  copyText(s.group, what.group);
  copyText(s.tag, what.tag);
  s.generation.store(2 * index + 2, std::memory_order_release);
  h.issued.store(index + 1, std::memory_order_release);
  return index;
}

Slot* Writer::live(std::uint64_t index) const {
  Slot& s = ring_.slot(index);
  return s.generation.load(std::memory_order_acquire) == 2 * index + 2 ? &s : nullptr;
}

void Writer::start(std::uint64_t index) {
  if (Slot* s = live(index)) s->startedNs.store(nowNs(), std::memory_order_relaxed);
}

void Writer::complete(std::uint64_t index, bool ok) {
  Slot* s = live(index);
  if (s == nullptr) return;
  // The first to tell wins (the recorder's watcher, or the caller's wait()).
  auto expected = static_cast<std::uint8_t>(SlotState::kIssued);
  const auto done = static_cast<std::uint8_t>(ok ? SlotState::kCompleted : SlotState::kFailed);
  if (!s->state.compare_exchange_strong(expected, done, std::memory_order_acq_rel)) return;
  const std::int64_t now = nowNs();
  if (s->startedNs.load(std::memory_order_relaxed) == 0) s->startedNs.store(now, std::memory_order_relaxed);
  s->completedNs.store(now, std::memory_order_release);
  auto& last = ring_.header().lastCompletedNs;
  std::int64_t seen = last.load(std::memory_order_relaxed);
  while (seen < now && !last.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

void Writer::publishTiming(const StepTiming& t) {
  Header& h = ring_.header();
  h.stepNs.store(t.stepNs, std::memory_order_relaxed);
  h.waitNs.store(t.waitNs, std::memory_order_relaxed);
  h.dataNs.store(t.dataNs, std::memory_order_relaxed);
  h.lastStepNs.store(t.lastStepNs, std::memory_order_relaxed);
  h.lastWaitNs.store(t.lastWaitNs, std::memory_order_relaxed);
  h.lastDataNs.store(t.lastDataNs, std::memory_order_relaxed);
  h.samples.store(t.samples, std::memory_order_relaxed);
  h.tokens.store(t.tokens, std::memory_order_relaxed);
  h.lastSamples.store(t.lastSamples, std::memory_order_relaxed);
  h.lastTokens.store(t.lastTokens, std::memory_order_relaxed);
  h.loss.store(t.loss, std::memory_order_relaxed);
  h.straggler.store(t.straggler, std::memory_order_relaxed);
  h.steps.store(t.steps, std::memory_order_release);
}

void Writer::addBytes(std::int64_t bytes) {
  ring_.header().bytes.fetch_add(bytes, std::memory_order_relaxed);
}

void Writer::setBusy(bool busy, std::string_view what) {
  // The text first: a reader that sees the time sees the text of this operation (or, torn, of
  // the one before it: text only, never a wrong time).
  if (busy) {
    // All 16 bytes: no terminator needed (readers stop at the field's end).
    auto& field = ring_.header().busyWhat;
    const std::string_view text = what.empty() ? std::string_view("long operation") : what;
    const std::size_t n = std::min(text.size(), sizeof(field));
    std::memcpy(field, text.data(), n);
    std::memset(field + n, 0, sizeof(field) - n);
  }
  ring_.header().busySinceNs.store(busy ? nowNs() : 0, std::memory_order_release);
}

void Writer::markProgress(std::int64_t step, std::string_view what) {
  Header& h = ring_.header();
  const std::int64_t now = nowNs();
  const std::int64_t previous = h.progressNs.load(std::memory_order_relaxed);
  if (previous != 0 && now - previous > h.longestGapNs.load(std::memory_order_relaxed)) {
    h.longestGapNs.store(now - previous, std::memory_order_relaxed);
  }
  copyText(h.progressWhat, what);
  if (step >= 0) h.progressStep.store(step, std::memory_order_relaxed);
  h.progressNs.store(now, std::memory_order_relaxed);
  h.progressCount.fetch_add(1, std::memory_order_release);
}

}  // namespace fsdp::flight
