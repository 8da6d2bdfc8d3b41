// The memory of full parameters and gradients (see full_buffer.hpp).
#include "full_buffer.hpp"

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <torch/version.h>

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>

#include "fsdp/common/env.hpp"
#include "fsdp/common/error.hpp"

namespace fsdp::worker::detail {
namespace {

// Full parameters and gradients are large and short-lived: allocated and freed once or twice
// per unit per step. Big CPU blocks are mapped directly with transparent huge pages
// advised, so that refilling a unit does not pay ~250k page faults per GB (measured: the
// system time of a FULL_SHARD DeepNet step was as large as its user time before).
constexpr std::size_t kMapThreshold = std::size_t{1} << 20;
constexpr std::size_t kMapHeader = 64;  // keeps the block's size; data stays 64-byte aligned

// A mapped block: its base (the header's) and the bytes mapped there.
struct Mapped {
  char* base = nullptr;
  std::size_t length = 0;
};

// A size in megabytes from the environment, `fallback` when unset; anything but a whole number
// from 0 to 2^30 (a petabyte) is refused with the variable's name, never read as a wrapped size.
std::size_t envBytesFromMb(const char* name, std::size_t fallbackMb) {
  const long long mb = envInt(processEnv(), name, static_cast<long long>(fallbackMb));
  if (mb < 0 || mb > (1LL << 30)) {
    throw ConfigError("environment variable " + std::string(name) + "='" + std::to_string(mb) +
                      "': expected megabytes, from 0 to 1073741824");
  }
  return static_cast<std::size_t>(mb) << 20;
}

// Freed blocks stay mapped for the next block of the same length, up to a budget: huge pages
// still fault in and are zeroed by the kernel on first touch, which cost a quarter of a rank's
// FULL_SHARD DeepNet step (perf: clear_page_erms under do_huge_pmd_anonymous_page) when every
// gather and gradient mapped fresh memory. A unit's block comes back for its next gather (or
// an equal-sized unit's), so what the cache holds is what the next step needs anyway.
// FSDP_BLOCK_CACHE_MB bounds it per process (default 1024; 0 turns it off).
//
// A new process's first step still faults every block in (DeepNet, 2 ranks on 2 cores: a median
// step of 0.85 s with FSDP_BLOCK_CACHE_MB=0 against 0.58 s; on a virtual machine whose host
// backs memory at its first touch, 1 GB takes 0.7-3 s), and the survivors wait on the first step
// of a lost rank's replacement. A spare (fsdprun --standby) faults in a reserve while it waits
// instead (startWarmingSpareBlocks); blocks the cache does not hold are cut from it. Its untouched rest
// counts against the same budget and gives way to freed blocks.
class BlockCache {
 public:
  BlockCache() : budget_(envBytesFromMb("FSDP_BLOCK_CACHE_MB", 1024)) {}
  std::size_t budget() const { return budget_; }
  // A cached block of exactly `length` bytes, else a piece of the reserve; base nullptr: neither.
  Mapped take(std::size_t length) {
    std::scoped_lock lock(mutex_);
    if (const auto it = blocks_.find(length); it != blocks_.end()) {
      const Mapped block = it->second;
      blocks_.erase(it);
      bytes_ -= block.length;
      return block;
    }
    const std::size_t piece = roundUp(length, kHugePage);
    if (reserveLeft_ < piece) return {};
    const Mapped block{reserveNext_, piece};
    reserveNext_ += piece;
    reserveLeft_ -= piece;
    bytes_ -= piece;
    return block;
  }
  // Keeps the block (looked up by `length`) when it fits the budget, the reserve's rest
  // shrinking first; false: the caller unmaps it.
  bool give(std::size_t length, Mapped block) {
    std::scoped_lock lock(mutex_);
    if (bytes_ + block.length > budget_) shrinkReserve(bytes_ + block.length - budget_);
    if (bytes_ + block.length > budget_) return false;
    blocks_.emplace(length, block);
    bytes_ += block.length;
    return true;
  }
  // Maps `bytes` (2 MB aligned, at most the budget, huge pages advised) and faults them in a
  // piece at a time, each piece taken into the reserve as it is in memory, until `stop`; the
  // rest is unmapped. Returns the bytes faulted in, 0 where it cannot.
  std::size_t reserve(std::size_t bytes, const std::atomic<bool>& stop, std::atomic<std::size_t>& done) {
    bytes = std::min(roundUp(bytes, kHugePage), budget_ / kHugePage * kHugePage);
    if (bytes == 0) return 0;
    {
      std::scoped_lock lock(mutex_);
      if (std::exchange(reserved_, true)) return 0;  // one reserve per process
    }
    const std::size_t span = bytes + kHugePage;
    void* raw = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return 0;
    auto* const start = static_cast<char*>(raw);
    auto* const base = reinterpret_cast<char*>(roundUp(reinterpret_cast<std::uintptr_t>(start), kHugePage));
    if (base > start) ::munmap(start, static_cast<std::size_t>(base - start));
    if (base + bytes < start + span) ::munmap(base + bytes, static_cast<std::size_t>(start + span - base - bytes));
    ::madvise(base, bytes, MADV_HUGEPAGE);
    std::size_t at = 0;
    while (at < bytes && !stop.load(std::memory_order_relaxed)) {
      const std::size_t piece = std::min(kWarmPiece, bytes - at);
      if (::madvise(base + at, piece, MADV_POPULATE_WRITE) != 0) {
        // Before Linux 5.14: a write per page.
        for (std::size_t page = 0; page < piece; page += 4096) static_cast<volatile char*>(base + at)[page] = 0;
      }
      std::scoped_lock lock(mutex_);
      // Closed: a freed block took the reserve's place (shrinkReserve), or the budget is full.
      if (reserveClosed_ || bytes_ + piece > budget_) break;
      if (reserveNext_ == nullptr) reserveNext_ = base;
      reserveLeft_ += piece;
      bytes_ += piece;
      at += piece;
      done.store(at, std::memory_order_relaxed);
    }
    if (at < bytes) ::munmap(base + at, bytes - at);
    return at;
  }

 private:
  static constexpr std::size_t kHugePage = std::size_t{2} << 20;
  static constexpr std::size_t kWarmPiece = std::size_t{32} << 20;  // a stop waits for one at most
  static constexpr std::size_t roundUp(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

  void shrinkReserve(std::size_t excess) {
    reserveClosed_ = true;  // a warm-up still under way takes no more pieces
    const std::size_t cut = std::min(reserveLeft_, roundUp(excess, kHugePage));
    if (cut == 0) return;
    ::munmap(reserveNext_ + reserveLeft_ - cut, cut);
    reserveLeft_ -= cut;
    bytes_ -= cut;
  }

  std::mutex mutex_;
  std::multimap<std::size_t, Mapped> blocks_;
  std::size_t bytes_ = 0;  // cached blocks and the reserve's rest
  std::size_t budget_ = 0;
  bool reserved_ = false;
  bool reserveClosed_ = false;
  char* reserveNext_ = nullptr;
  std::size_t reserveLeft_ = 0;
};

// Never destroyed: blocks are freed from tensor deleters, which may run during exit.
BlockCache& blockCache() {
  static auto* cache = new BlockCache();
  return *cache;
}

// The header before a block's data: the length it is cached under, and what is mapped.
struct BlockHeader {
  std::size_t length;
  std::size_t mapped;
};
static_assert(sizeof(BlockHeader) <= kMapHeader);

void freeMapped(void* base) {
  BlockHeader header{};
  std::memcpy(&header, base, sizeof header);
  if (!blockCache().give(header.length, {static_cast<char*>(base), header.mapped})) {
    ::munmap(base, header.mapped);
  }
}

at::DataPtr mapBlock(std::size_t nbytes, at::Device device) {
  const std::size_t length = nbytes + kMapHeader;
  Mapped block = blockCache().take(length);
  if (block.base == nullptr) {
    void* base = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
      throw Error("fsdp: cannot map " + std::to_string(nbytes) + " bytes for full parameters: " +
                  std::strerror(errno));
    }
    ::madvise(base, length, MADV_HUGEPAGE);  // advice only: ignored where THP is off
    block = {static_cast<char*>(base), length};
  }
  const BlockHeader header{length, block.length};
  std::memcpy(block.base, &header, sizeof header);
  return at::DataPtr(block.base + kMapHeader, block.base, &freeMapped, device);
}

// The deleters of full-parameter memory. Besides freeing, they mark a storage as managed by
// FSDP: a second wrap of the same parameters is recognised by them, with no global registry.
void freeCpuFull(void* ptr) { c10::GetAllocator(c10::DeviceType::CPU)->raw_deallocate(ptr); }
void freeCudaFull(void* ptr) { c10::GetAllocator(c10::DeviceType::CUDA)->raw_deallocate(ptr); }

at::DataPtr allocateBlock(std::size_t nbytes, at::Device device) {
  if (device.is_cpu() && nbytes >= kMapThreshold) return mapBlock(nbytes, device);
  void* ptr = c10::GetAllocator(device.type())->raw_allocate(nbytes);
  return at::DataPtr(ptr, ptr, device.is_cuda() ? &freeCudaFull : &freeCpuFull, device);
}

// FSDP_CPU_BLOCK_ALLOCATOR=1: LibTorch's CPU tensors of kMapThreshold or more come from the
// block cache too (the optimizer's state and temporaries, autograd's, the snapshots' copies), so
// that a step maps no fresh memory for them once the cache holds their sizes, and a spare's
// warmed memory serves them. Smaller ones go to the allocator it replaced. LibTorch also
// allocates raw (oneDNN's buffers) and frees such memory through raw_deleter(), one function for
// every size: the blocks it hands out are kept in a set, which that function looks up.
// LibTorch 2.3 made Allocator::allocate non-const and copy_data pure virtual.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define FSDP_ALLOCATE_CONST
#define FSDP_ALLOCATOR_COPY_DATA 1
#else
#define FSDP_ALLOCATE_CONST const
#define FSDP_ALLOCATOR_COPY_DATA 0
#endif
class BlockAllocator final : public c10::Allocator {
 public:
  explicit BlockAllocator(c10::Allocator* original) : original_(original) {}

  at::DataPtr allocate(std::size_t nbytes) FSDP_ALLOCATE_CONST override {
    if (nbytes < kMapThreshold) return original_->allocate(nbytes);
    at::DataPtr block = mapBlock(nbytes, at::Device(at::kCPU));
    // The data is its own context (raw_allocate's rule); the header sits just before it.
    void* const data = static_cast<char*>(block.release_context()) + kMapHeader;
    {
      std::scoped_lock lock(mutex_);
      live_.insert(data);
    }
    return at::DataPtr(data, data, &freeBlock, at::Device(at::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &freeRaw; }
#if FSDP_ALLOCATOR_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#endif

  static BlockAllocator*& instance() {
    static BlockAllocator* self = nullptr;
    return self;
  }

 private:
  static void freeBlock(void* data) {
    {
      auto* self = instance();
      std::scoped_lock lock(self->mutex_);
      self->live_.erase(data);
    }
    freeMapped(static_cast<char*>(data) - kMapHeader);
  }
  static void freeRaw(void* data) {
    auto* self = instance();
    bool ours = false;
    {
      std::scoped_lock lock(self->mutex_);
      ours = self->live_.contains(data);
    }
    if (ours) {
      freeBlock(data);
    } else {
      self->original_->raw_deleter()(data);
    }
  }

  c10::Allocator* original_;
  mutable std::mutex mutex_;
  mutable std::unordered_set<void*> live_;
};
#undef FSDP_ALLOCATE_CONST
#undef FSDP_ALLOCATOR_COPY_DATA

// Once per process; never destroyed: tensors it made may be freed during exit.
void installCpuBlockAllocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    BlockAllocator::instance() = new BlockAllocator(c10::GetAllocator(c10::DeviceType::CPU));
    c10::SetAllocator(c10::DeviceType::CPU, BlockAllocator::instance(), /*priority=*/1);
  });
}

// The spare's warm-up: its thread, which ends on its own, and what it did.
struct Warming {
  std::atomic<bool> stop{false};
  std::atomic<std::size_t> done{0};
  std::mutex mutex;
  std::condition_variable ended;
  bool running = false;
  bool idleClass = false;
};

Warming& warming() {
  static auto* w = new Warming();  // never destroyed: the thread may outlive main
  return *w;
}

}  // namespace

void startWarmingSpareBlocks() {
  // Blocks of a LibTorch with CUDA are most likely the device's, never these.
  if (at::hasCUDA()) return;
  const std::size_t bytes = envBytesFromMb("FSDP_SPARE_WARM_MB", blockCache().budget() >> 20);
  if (bytes == 0) return;
  // Never at the cost of the host's memory: a quarter of what is available at most.
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::size_t kb = 0;
  while (meminfo >> key >> kb && key != "MemAvailable:") meminfo.ignore(256, '\n');
  if (key != "MemAvailable:" || (kb << 10) / 4 < bytes) return;
  Warming& w = warming();
  {
    std::scoped_lock lock(w.mutex);
    if (w.running) return;
    w.running = true;
  }
  // The idle scheduling class: it runs only on CPU time the round's workers leave (on 2 cores,
  // the two spares started after a resume faulted in 1 GB each at normal priority for ~10 s,
  // half a core each, beside the steps of the replacement they warm up for). The kernel's work
  // of faulting in is done on this thread, in that class too. Detached: a stop never waits.
  std::thread([bytes, &w] {
    const sched_param none{};
    const bool idle = ::pthread_setschedparam(::pthread_self(), SCHED_IDLE, &none) == 0;
    blockCache().reserve(bytes, w.stop, w.done);
    std::scoped_lock lock(w.mutex);
    w.idleClass = idle;
    w.running = false;
    w.ended.notify_all();
  }).detach();
}

std::size_t stopWarmingSpareBlocks() {
  Warming& w = warming();
  w.stop.store(true);
  return w.done.load();
}

WarmedBlocks awaitWarmedSpareBlocks() {
  Warming& w = warming();
  std::unique_lock lock(w.mutex);
  w.ended.wait(lock, [&] { return !w.running; });
  return {.bytes = w.done.load(), .idleClass = w.idleClass};
}

void checkBlockEnvironment() {
  blockCache();
  envBytesFromMb("FSDP_SPARE_WARM_MB", 0);
  if (envFlag(processEnv(), "FSDP_CPU_BLOCK_ALLOCATOR", false)) installCpuBlockAllocator();
}


bool managedByFsdp(const at::Tensor& tensor) {
  if (!tensor.has_storage()) return false;
  const auto deleter = tensor.storage().data_ptr().get_deleter();
  return deleter == &freeCpuFull || deleter == &freeCudaFull || deleter == &freeMapped;
}

at::Tensor emptyBlock(std::int64_t numel, const at::TensorOptions& options) {
  const std::size_t nbytes =
      static_cast<std::size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, allocateBlock(nbytes, options.device()),
                       nullptr, /*resizable=*/false);
  return at::empty({0}, options).set_(storage, 0, {numel}, {1});
}

FullBuffer::FullBuffer(std::int64_t numel, at::ScalarType dtype, at::Device device)
    : numel_(numel), dtype_(dtype), device_(device) {
  storage_ = c10::Storage(c10::Storage::use_byte_size_t(), 0, emptyPtr(),
                          c10::GetAllocator(device.type()), /*resizable=*/false);
}

FullBuffer FullBuffer::permanent(const at::Tensor& values) {
  FullBuffer b(values.numel(), values.scalar_type(), values.device());
  b.allocate();
  b.flat().copy_(values);
  b.alias_ = true;
  return b;
}

void FullBuffer::allocate() {
  if (allocated() || alias_) return;
  const std::size_t nbytes = static_cast<std::size_t>(numel_) * c10::elementSize(dtype_);
  storage_.unsafeGetStorageImpl()->set_data_ptr_noswap(allocateBlock(nbytes, device_));
  storage_.unsafeGetStorageImpl()->set_nbytes(nbytes);
}

void FullBuffer::free() {
  if (alias_) return;
  storage_.unsafeGetStorageImpl()->set_data_ptr_noswap(emptyPtr());
  storage_.unsafeGetStorageImpl()->set_nbytes(0);
}

at::Tensor FullBuffer::view(std::int64_t offset, at::IntArrayRef shape) const {
  return at::empty({0}, at::TensorOptions().dtype(dtype_).device(device_))
      .set_(storage_, offset, shape, c10::contiguous_strides(shape));
}

at::DataPtr FullBuffer::emptyPtr() const {
  return at::DataPtr(nullptr, nullptr, device_.is_cuda() ? &freeCudaFull : &freeCpuFull, device_);
}

}  // namespace fsdp::worker::detail
