#pragma once
// The shared-memory communicator's copy and sum kernels (shm_communicator.cpp): what moves the
// bytes between the ranks' slots and their tensors. Private to libfsdp.

#include <cstddef>
#include <cstdint>

namespace fsdp::worker::detail {

// Outputs at least this large are written with non-temporal stores: they do not fit the
// caches anyway, and a streaming store skips reading each destination line before writing it
// (a third of an all-gather's memory traffic). Smaller outputs stay in cache for their reader.
constexpr std::size_t kStreamBytes = std::size_t{8} << 20;

// memcpy that bypasses the caches for the destination (x86-64: SSE2 streaming stores, which
// every x86-64 has); elsewhere a plain memcpy.
void streamCopy(void* dst, const void* src, std::size_t n);
void copyBytes(void* dst, const void* src, std::size_t n);

// out[i] = (terms[0][i] + terms[1][i] + ... in that order) / divisor (divisor 1: none), float32,
// in one pass with streaming stores (x86-64). The same IEEE operations in the same order as
// add_out, add_ and div_ by a power of two do them, so the same bits in fewer passes.
void sumFloats(float* out, const float* const* terms, int count, float divisor, std::int64_t len);

}  // namespace fsdp::worker::detail
