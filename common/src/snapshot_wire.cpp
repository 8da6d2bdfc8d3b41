// The snapshot piece format and the worker-keeper socket (see snapshot_wire.hpp).
#include "fsdp/common/snapshot_wire.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "fsdp/common/error.hpp"
#include "fsdp/common/sha256.hpp"

namespace fsdp::snapshot {

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Fd createMemfd(const std::string& name, std::uint64_t bytes) {
  Fd fd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) throwErrno("memfd_create " + name, errno);
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    throwErrno("sizing the snapshot " + name + " to " + std::to_string(bytes) + " bytes", errno);
  }
  return fd;
}

void sealPiece(int fd, bool writes) {
  const int seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL | (writes ? F_SEAL_WRITE : 0);
  if (::fcntl(fd, F_ADD_SEALS, seals) != 0) throwErrno("sealing a snapshot", errno);
}

bool isSealed(int fd) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  const int want = F_SEAL_SHRINK | F_SEAL_GROW;
  return seals >= 0 && (seals & want) == want;
}

std::uint64_t fileBytes(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throwErrno("fstat of a snapshot", errno);
  return static_cast<std::uint64_t>(st.st_size);
}

namespace {

std::uint64_t readU64(const char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

void putU64(char* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

void preadAll(int fd, void* data, std::size_t n, std::uint64_t offset, const std::string& where) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throwErrno("reading " + where, errno);
    if (r == 0) throw Error(where + " is truncated");
    p += r;
    n -= static_cast<std::size_t>(r);
    offset += static_cast<std::uint64_t>(r);
  }
}

}  // namespace

std::uint64_t checkPiecePrefix(int fd, const std::string& where) {
  const std::uint64_t size = fileBytes(fd);
  if (size < kPrefixBytes) throw Error(where + " is not a snapshot (" + std::to_string(size) + " bytes)");
  char prefix[kPrefixBytes];
  preadAll(fd, prefix, sizeof(prefix), 0, where);
  if (std::memcmp(prefix, kMagic, sizeof(kMagic)) != 0) throw Error(where + " is not a snapshot (bad magic)");
  const std::uint64_t dataOffset = readU64(prefix + 8);
  const std::uint64_t headerBytes = readU64(prefix + 16);
  if (headerBytes > kMaxMessage * 64 || dataOffset != dataOffsetFor(headerBytes) || dataOffset > size) {
    throw Error(where + " has a malformed prefix (header " + std::to_string(headerBytes) + " bytes, data at " +
                std::to_string(dataOffset) + " of " + std::to_string(size) + ")");
  }
  return headerBytes;
}

std::string readPieceHeader(int fd, const std::string& where) {
  std::string header(checkPiecePrefix(fd, where), '\0');
  preadAll(fd, header.data(), header.size(), kPrefixBytes, where);
  return header;
}

void writePiecePrefix(char* base, std::string_view header) {
  std::memcpy(base, kMagic, sizeof(kMagic));
  putU64(base + 8, dataOffsetFor(header.size()));
  putU64(base + 16, header.size());
  std::memcpy(base + kPrefixBytes, header.data(), header.size());
}

namespace {

sockaddr_un abstractAddress(const std::string& name, socklen_t& length) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (name.size() + 1 > sizeof(addr.sun_path)) throw ConfigError("snapshot socket name '" + name + "' is too long");
  addr.sun_path[0] = '\0';
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

}  // namespace

int listenSeqpacket(const std::string& name) {
  socklen_t length = 0;
  const auto addr = abstractAddress(name, length);
  Fd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd) throwErrno("socket for snapshots", errno);
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), length) != 0) {
    throwErrno("binding the snapshot socket @" + name, errno);
  }
  if (::listen(fd.get(), 64) != 0) throwErrno("listen on the snapshot socket", errno);
  return fd.release();
}

int connectSeqpacket(const std::string& name) {
  socklen_t length = 0;
  const auto addr = abstractAddress(name, length);
  Fd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd) throwErrno("socket for snapshots", errno);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), length) != 0) {
    throwErrno("connecting to the agent's snapshot socket @" + name, errno);
  }
  return fd.release();
}

void sendMessage(int sock, std::string_view text, int fd) {
  iovec iov{const_cast<char*>(text.data()), text.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  for (;;) {
    const ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n >= 0) return;
    if (errno == EINTR) continue;
    throwErrno("sending to the snapshot keeper", errno);
  }
}

std::optional<std::pair<std::string, Fd>> receiveMessage(int sock) {
  // One buffer per thread: a message arrives every step, and most are a few bytes.
  thread_local std::vector<char> buffer(kMaxMessage);
  iovec iov{buffer.data(), buffer.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n = 0;
  for (;;) {
    n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n >= 0) break;
    if (errno == EINTR) continue;
    if (errno == ECONNRESET) return std::nullopt;
    throwErrno("receiving from the snapshot socket", errno);
  }
  Fd passed;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len >= CMSG_LEN(sizeof(int))) {
      int fd = -1;
      std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
      passed = Fd(fd);
    }
  }
  if (n == 0 && !passed) return std::nullopt;
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) throw Error("a snapshot message was truncated");
  return std::make_pair(std::string(buffer.data(), static_cast<std::size_t>(n)), std::move(passed));
}

std::string peerMac(const std::string& token, const std::string& runId, int rank, int world, std::int64_t step,
                    std::uint64_t bytes) {
  const std::string message = "fsdprun-snapshot|" + runId + "|" + std::to_string(rank) + "|" + std::to_string(world) +
                              "|" + std::to_string(step) + "|" + std::to_string(bytes);
  const auto mac = hmacSha256(token, message);
  return toHex(std::string_view(reinterpret_cast<const char*>(mac.data()), mac.size()));
}

std::string getMac(const std::string& token, const std::string& runId, int rank, int world, std::int64_t step) {
  const std::string message = "fsdprun-snapshot-get|" + runId + "|" + std::to_string(rank) + "|" +
                              std::to_string(world) + "|" + std::to_string(step);
  const auto mac = hmacSha256(token, message);
  return toHex(std::string_view(reinterpret_cast<const char*>(mac.data()), mac.size()));
}

void writeFrame(int fd, std::string_view text) {
  // One send: a length sent alone would wait for the peer's delayed ACK (Nagle).
  const auto length = static_cast<std::uint32_t>(text.size());
  std::string frame(sizeof(length) + text.size(), '\0');
  std::memcpy(frame.data(), &length, sizeof(length));
  std::memcpy(frame.data() + sizeof(length), text.data(), text.size());
  writeAll(fd, frame.data(), frame.size());
}

std::optional<std::string> readFrame(int fd, const std::string& where) {
  std::uint32_t length = 0;
  if (!readAll(fd, &length, sizeof(length))) return std::nullopt;
  if (length > kMaxFrame) {
    throw ProtocolError(where + " sent a frame of " + std::to_string(length) + " bytes (at most " +
                        std::to_string(kMaxFrame) + ")");
  }
  std::string text(length, '\0');
  if (!readAll(fd, text.data(), text.size())) return std::nullopt;
  return text;
}

bool readAll(int fd, void* data, std::size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throwErrno("reading a snapshot stream", errno);
    if (r == 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

void writeAll(int fd, const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throwErrno("writing a snapshot stream", errno);
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

}  // namespace fsdp::snapshot
