#pragma once
// In-memory snapshots, the parts both sides share: the worker (libfsdp) that writes a snapshot
// piece and the agent's keeper (fsdprun) that holds it.
//
// A piece is one rank's training state at one step, in a sealed memfd:
//   bytes 0..7    "FSDPSNP1"
//   bytes 8..15   little-endian u64: where the data starts (a multiple of 4096)
//   bytes 16..23  little-endian u64: length of the header JSON that follows
//   header JSON   {"rank", "world", "step", "meta" (the checkpoint metadata), "blocks"}
//   data          the blocks, at their offsets relative to the data start
// Sealed against growing and shrinking before it leaves the worker (a reader can never run off
// its end); the worker writes into a piece's memory again only once its keeper says it no
// longer holds it (no fresh pages to fault in every step). A keeper's own peer copies are
// sealed against writes too. A piece is released when the last descriptor closes (nothing in
// /dev/shm).
//
// Worker and keeper talk over an abstract Unix SOCK_SEQPACKET socket, one JSON message per
// packet, with at most one descriptor attached (SCM_RIGHTS).

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace fsdp::snapshot {

inline constexpr char kMagic[8] = {'F', 'S', 'D', 'P', 'S', 'N', 'P', '1'};
inline constexpr std::uint64_t kPrefixBytes = 24;
inline constexpr std::uint64_t kAlign = 4096;
inline constexpr std::size_t kMaxMessage = 1 << 20;

// Owns a file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset();

 private:
  int fd_ = -1;
};

// A new memfd of `bytes` (close-on-exec, sealable). Throws Error.
Fd createMemfd(const std::string& name, std::uint64_t bytes);
// Seals it against growing and shrinking, and against writes when `writes` (no writable mapping
// may remain then).
void sealPiece(int fd, bool writes);
// Whether its size is sealed.
bool isSealed(int fd);
std::uint64_t fileBytes(int fd);

// The header JSON of a piece; throws Error (naming `where`) when the prefix is not a piece's.
std::string readPieceHeader(int fd, const std::string& where);
// The same check of the prefix, without reading the header: the header's length.
std::uint64_t checkPiecePrefix(int fd, const std::string& where);
// Where the data of a piece whose header JSON is `headerBytes` long starts.
inline std::uint64_t dataOffsetFor(std::uint64_t headerBytes) {
  return (kPrefixBytes + headerBytes + kAlign - 1) / kAlign * kAlign;
}
// Writes the prefix and header into the first bytes of a mapped piece.
void writePiecePrefix(char* base, std::string_view header);

// The abstract socket name ("\0" + name) a keeper listens on.
int listenSeqpacket(const std::string& name);
int connectSeqpacket(const std::string& name);
// One message (and optionally one descriptor). Throws Error when the peer is gone.
void sendMessage(int sock, std::string_view text, int fd = -1);
// The next message and the descriptor that came with it; nullopt when the peer closed.
std::optional<std::pair<std::string, Fd>> receiveMessage(int sock);

// The MAC a peer stream's header carries: HMAC-SHA256 under the job token of the other fields.
std::string peerMac(const std::string& token, const std::string& runId, int rank, int world, std::int64_t step,
                    std::uint64_t bytes);
// The MAC of a remote get's header (a keeper hands a piece only to the job). Its message differs
// from peerMac's in its first field: a put header can never pass as a get.
std::string getMac(const std::string& token, const std::string& runId, int rank, int world, std::int64_t step);

// The largest header or reply a TCP snapshot stream carries.
inline constexpr std::uint32_t kMaxFrame = 65536;
// One frame on a TCP snapshot stream: a u32 length (host order) and that many bytes of JSON.
void writeFrame(int fd, std::string_view text);
// The next frame; nullopt when the peer closed before it. Throws ProtocolError when its length
// is over kMaxFrame, Error on a read error or timeout.
std::optional<std::string> readFrame(int fd, const std::string& where);

// Reads and writes all of a buffer on a stream socket (blocking); false when the peer closed.
bool readAll(int fd, void* data, std::size_t n);
void writeAll(int fd, const void* data, std::size_t n);

}  // namespace fsdp::snapshot
