// The shared-memory communicator's kernels (shm_kernels.hpp).
#include "comm/shm/shm_kernels.hpp"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <cstring>

namespace fsdp::worker::detail {

// memcpy that bypasses the caches for the destination (x86-64: SSE2 streaming stores, which
// every x86-64 has); elsewhere a plain memcpy.
void streamCopy(void* dst, const void* src, std::size_t n) {
#if defined(__x86_64__)
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const std::size_t head = (16 - reinterpret_cast<std::uintptr_t>(d) % 16) % 16;
  if (n < head + 64) {
    std::memcpy(d, s, n);
    return;
  }
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  for (; n >= 64; n -= 64, d += 64, s += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  std::memcpy(d, s, n);
  _mm_sfence();  // the streamed lines are visible before anything later (a barrier's store)
#else
  std::memcpy(dst, src, n);
#endif
}

void copyBytes(void* dst, const void* src, std::size_t n) { std::memcpy(dst, src, n); }

// out[i] = (terms[0][i] + terms[1][i] + ... in that order) / divisor (divisor 1: none), float32,
// in one pass with streaming stores (x86-64). The same IEEE operations in the same order as
// add_out, add_ and div_ by a power of two do them, so the same bits in fewer passes.
void sumFloats(float* out, const float* const* terms, int count, float divisor, std::int64_t len) {
  std::int64_t i = 0;
  const auto scalar = [&](std::int64_t k) {
    float v = terms[0][k] + terms[1][k];
    for (int t = 2; t < count; ++t) v += terms[t][k];
    out[k] = divisor != 1.0F ? v / divisor : v;
  };
#if defined(__x86_64__)
  for (; i < len && reinterpret_cast<std::uintptr_t>(out + i) % 16 != 0; ++i) scalar(i);
  const __m128 d = _mm_set1_ps(divisor);
  for (; i + 4 <= len; i += 4) {
    __m128 v = _mm_add_ps(_mm_loadu_ps(terms[0] + i), _mm_loadu_ps(terms[1] + i));
    for (int t = 2; t < count; ++t) v = _mm_add_ps(v, _mm_loadu_ps(terms[t] + i));
    if (divisor != 1.0F) v = _mm_div_ps(v, d);
    _mm_stream_ps(out + i, v);
  }
  _mm_sfence();
#endif
  for (; i < len; ++i) scalar(i);
}

}  // namespace fsdp::worker::detail
