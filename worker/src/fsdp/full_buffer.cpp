// The memory of full parameters and gradients (see full_buffer.hpp).
#include "full_buffer.hpp"

#include <ATen/Functions.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>

#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "fsdp/common/error.hpp"

namespace fsdp::worker::detail {
namespace {

// Full parameters and gradients are large and short-lived: allocated and freed once or twice
// per unit per step. Big CPU blocks are mapped directly with transparent huge pages
// advised, so that refilling a unit does not pay ~250k page faults per GB (measured: the
// system time of a FULL_SHARD DeepNet step was as large as its user time before).
constexpr std::size_t kMapThreshold = std::size_t{1} << 20;
constexpr std::size_t kMapHeader = 64;  // keeps the block's size; data stays 64-byte aligned

// Freed blocks stay mapped for the next block of the same length, up to a budget: huge pages
// still fault in and are zeroed by the kernel on first touch, which cost a quarter of a rank's
// FULL_SHARD DeepNet step (perf: clear_page_erms under do_huge_pmd_anonymous_page) when every
// gather and gradient mapped fresh memory. A unit's block comes back for its next gather (or
// an equal-sized unit's), so what the cache holds is what the next step needs anyway.
// FSDP_BLOCK_CACHE_MB bounds it per process (default 1024; 0 turns it off).
class BlockCache {
 public:
  BlockCache() {
    const char* mb = std::getenv("FSDP_BLOCK_CACHE_MB");
    budget_ = (mb != nullptr ? std::strtoull(mb, nullptr, 10) : 1024ULL) << 20;
  }
  // A cached block of exactly `length` bytes, or nullptr.
  void* take(std::size_t length) {
    std::scoped_lock lock(mutex_);
    const auto it = blocks_.find(length);
    if (it == blocks_.end()) return nullptr;
    void* base = it->second;
    blocks_.erase(it);
    bytes_ -= length;
    return base;
  }
  // Keeps the block when it fits the budget; false: the caller unmaps it.
  bool give(void* base, std::size_t length) {
    std::scoped_lock lock(mutex_);
    if (bytes_ + length > budget_) return false;
    blocks_.emplace(length, base);
    bytes_ += length;
    return true;
  }

 private:
  std::mutex mutex_;
  std::multimap<std::size_t, void*> blocks_;
  std::size_t bytes_ = 0;
  std::size_t budget_ = 0;
};

// Never destroyed: blocks are freed from tensor deleters, which may run during exit.
BlockCache& blockCache() {
  static auto* cache = new BlockCache();
  return *cache;
}

void freeMapped(void* base) {
  std::size_t length = 0;
  std::memcpy(&length, base, sizeof length);
  if (!blockCache().give(base, length)) ::munmap(base, length);
}

at::DataPtr mapBlock(std::size_t nbytes, at::Device device) {
  const std::size_t length = nbytes + kMapHeader;
  if (void* cached = blockCache().take(length)) {
    return at::DataPtr(static_cast<char*>(cached) + kMapHeader, cached, &freeMapped, device);
  }
  void* base = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    throw Error("fsdp: cannot map " + std::to_string(nbytes) + " bytes for full parameters: " +
                std::strerror(errno));
  }
  ::madvise(base, length, MADV_HUGEPAGE);  // advice only: ignored where THP is off
  std::memcpy(base, &length, sizeof length);
  return at::DataPtr(static_cast<char*>(base) + kMapHeader, base, &freeMapped, device);
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

}  // namespace

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
