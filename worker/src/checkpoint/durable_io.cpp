// Durable file I/O: fsync'ed writes, directory syncs, whole-file reads, CRC-32 (File, the
// fd owner, is in checkpoint_internal.hpp).
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include "checkpoint_internal.hpp"

namespace fsdp::worker::detail {

void syncDirectory(const std::string& path) {
  File dir(path, O_RDONLY | O_DIRECTORY);
  dir.sync();
}

void writeFileDurably(const std::string& path, std::string_view text) {
  File f(path, O_WRONLY | O_CREAT | O_TRUNC);
  f.writeAll(text.data(), text.size());
  f.sync();
}

std::string readText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("checkpoint: cannot read " + path + " (" + std::strerror(errno) + ")");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::uint32_t crc32Of(const void* data, std::size_t n) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(data);
  while (n > 0) {
    const auto chunk = static_cast<uInt>(std::min<std::size_t>(n, 1u << 30));
    crc = ::crc32(crc, p, chunk);
    p += chunk;
    n -= chunk;
  }
  return static_cast<std::uint32_t>(crc);
}

}  // namespace fsdp::worker::detail
