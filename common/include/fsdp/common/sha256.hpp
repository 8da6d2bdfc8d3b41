#pragma once
// SHA-256 (FIPS 180-4), used to fingerprint parameters (`params_sha256`) so that runs can
// be compared bit for bit. Not thread-safe per object; objects are cheap.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace fsdp {

class Sha256 {
 public:
  Sha256();
  void update(std::span<const std::byte> data);
  void update(std::string_view text) { update(std::as_bytes(std::span(text.data(), text.size()))); }
  // Finishes the hash; the object must not be updated afterwards.
  std::array<std::uint8_t, 32> digest();
  // digest() as 64 lowercase hex characters.
  std::string hexDigest();

 private:
  void compress(const std::uint8_t* block);
  std::array<std::uint32_t, 8> state_;
  std::array<std::uint8_t, 64> buffer_{};
  std::size_t buffered_ = 0;
  std::uint64_t totalBytes_ = 0;
};

}  // namespace fsdp

namespace fsdp {

// HMAC-SHA256 (RFC 2104) of `message` under `key`.
std::array<std::uint8_t, 32> hmacSha256(std::string_view key, std::string_view message);

// Compares in time that depends only on the lengths, not on where the inputs differ.
bool constantTimeEqual(std::string_view a, std::string_view b);

// `n` bytes from the kernel's CSPRNG (getrandom); throws Error if it fails.
std::string randomBytes(std::size_t n);

// Lowercase hex of bytes.
std::string toHex(std::string_view bytes);

}  // namespace fsdp
