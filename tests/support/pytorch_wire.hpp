#pragma once
// PyTorch TCPStore requests as bytes, for tests and benchmarks that play a client by hand:
// an opcode byte, then fields (strings with a u64 little-endian length, numbers as u64).
// Header-only: the benchmarks include it too.

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace fsdp::testing::pytorch_wire {

using Bytes = std::vector<std::uint8_t>;

inline Bytes u64(std::uint64_t v) {
  Bytes out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  return out;
}

inline Bytes str(const std::string& s) {
  Bytes out = u64(s.size());
  out.insert(out.end(), s.begin(), s.end());
  return out;
}

// An opcode and its fields.
inline Bytes request(std::uint8_t op, std::initializer_list<Bytes> fields) {
  Bytes out{op};
  for (const auto& f : fields) out.insert(out.end(), f.begin(), f.end());
  return out;
}

// PyTorch 1.13's SET (opcode 0, no reply) and `times` pipelined GETs (opcode 2).
inline Bytes set113(const std::string& key, const std::string& value) {
  return request(0, {str(key), str(value)});
}

inline Bytes gets113(const std::string& key, int times) {
  const Bytes one = request(2, {str(key)});
  Bytes out;
  for (int i = 0; i < times; ++i) out.insert(out.end(), one.begin(), one.end());
  return out;
}

}  // namespace fsdp::testing::pytorch_wire
