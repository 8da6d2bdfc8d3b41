#pragma once
// The memory of full parameters and full gradients: big short-lived blocks (mapped with huge
// pages on CPU), and FullBuffer, whose memory is freed and refilled under one StorageImpl that
// autograd's saved tensors keep referencing. Private to libfsdp.

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <cstddef>
#include <cstdint>

namespace fsdp::worker::detail {

// True when the tensor's memory was allocated here (a parameter already wrapped by FSDP).
bool managedByFsdp(const at::Tensor& tensor);

// For a spare (fsdprun --standby) while it waits, before the program builds its model: faults in
// the memory its first step's blocks are cut from, so that the step the survivors wait on does
// not fault them in. FSDP_SPARE_WARM_MB (default: FSDP_BLOCK_CACHE_MB's budget, which it counts
// against; 0: none). Nothing where LibTorch has CUDA or the host has under 4 times that
// available. It runs on a thread of its own in the idle scheduling class, a piece at a time, each
// piece usable once in memory; a bad value throws ConfigError here.
void startWarmingSpareBlocks();
// At the spare's activation: the warm-up takes no further piece (it is not waited for); returns
// the bytes faulted in so far.
std::size_t stopWarmingSpareBlocks();
// The warm-up's end, waited for (tests): the bytes faulted in, and whether it ran in the idle class.
struct WarmedBlocks {
  std::size_t bytes = 0;
  bool idleClass = false;
};
WarmedBlocks awaitWarmedSpareBlocks();

// fsdp::init(), in every worker: FSDP_BLOCK_CACHE_MB and FSDP_SPARE_WARM_MB are read now, so that
// a bad value stops the job at its start (ConfigError naming the variable) instead of killing
// only the spares, which alone use FSDP_SPARE_WARM_MB, or a worker at its first block; and
// FSDP_CPU_BLOCK_ALLOCATOR (0, the default, or 1: LibTorch's CPU tensors of 1 MB or more are then
// cut from the same block cache as FSDP's blocks, and from a spare's warmed memory, within
// FSDP_BLOCK_CACHE_MB).
void checkBlockEnvironment();

// A 1-D tensor of `numel` elements over a fresh block (uninitialised).
at::Tensor emptyBlock(std::int64_t numel, const at::TensorOptions& options);

// The memory every original parameter of one flat parameter points into. Freeing and
// refilling keep the same StorageImpl, which autograd's saved tensors still reference.
class FullBuffer {
 public:
  FullBuffer() = default;
  FullBuffer(std::int64_t numel, at::ScalarType dtype, at::Device device);
  // A buffer that is never freed and holds `values` (NO_SHARD, or one rank, without mixed
  // precision: the full parameter is the shard). Allocated here so that it carries the mark.
  static FullBuffer permanent(const at::Tensor& values);

  bool aliasing() const { return alias_; }
  bool allocated() const { return storage_.nbytes() > 0; }
  std::int64_t bytes() const { return static_cast<std::int64_t>(storage_.nbytes()); }
  void allocate();
  void free();
  // A tensor over [offset, offset + numel) of the buffer with the given shape.
  at::Tensor view(std::int64_t offset, at::IntArrayRef shape) const;
  at::Tensor flat() const { return view(0, {numel_}); }

 private:
  at::DataPtr emptyPtr() const;

  std::int64_t numel_ = 0;
  at::ScalarType dtype_ = at::kFloat;
  at::Device device_ = at::kCPU;
  c10::Storage storage_;
  bool alias_ = false;
};

}  // namespace fsdp::worker::detail
