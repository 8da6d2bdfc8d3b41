// The worker's TCP client of snapshot keepers (snapshot_fetch.hpp): connecting under a
// deadline, and the remote get of a piece into a sealed memfd.
#include "snapshot_fetch.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>

#include "fsdp/common/error.hpp"

namespace fsdp::worker::detail {

using nlohmann::json;
using snapshot::Fd;

namespace {

// A piece larger than this is a corrupt reply, not a piece (1 TiB).
constexpr std::uint64_t kMaxPieceBytes = std::uint64_t{1} << 40;

sockaddr_in parseEndpoint(const std::string& endpoint) {
  const auto colon = endpoint.rfind(':');
  if (colon == std::string::npos)
    throw ConfigError("snapshot keeper endpoint '" + endpoint + "': expected HOST:PORT");
  int port = -1;
  try {
    port = std::stoi(endpoint.substr(colon + 1));
  } catch (const std::exception&) {
    port = -1;
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (port <= 0 || port > 65535 ||
      ::inet_pton(AF_INET, endpoint.substr(0, colon).c_str(), &addr.sin_addr) != 1) {
    throw ConfigError("snapshot keeper endpoint '" + endpoint + "' is not an IPv4 HOST:PORT");
  }
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  return addr;
}

}  // namespace

void setSocketTimeouts(int fd, std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>(timeout.count() % 1000 * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

Fd connectKeeper(const std::string& endpoint, std::chrono::milliseconds timeout) {
  const sockaddr_in addr = parseEndpoint(endpoint);
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throwErrno("socket for the snapshot keeper at " + endpoint, errno);
  // Connect with SO_SNDTIMEO set: a blocking connect gives up after it (EINPROGRESS).
  setSocketTimeouts(fd.get(), timeout);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int error = errno == EINPROGRESS ? ETIMEDOUT : errno;
    throw NetworkError("connecting to the snapshot keeper at " + endpoint +
                           " failed after at most " + std::to_string(timeout.count()) +
                           " ms: " + std::strerror(error),
                       endpoint);
  }
  const int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

Fd fetchPiece(const PieceRequest& request, std::chrono::milliseconds timeout) {
  const std::string what = "the snapshot of rank " + std::to_string(request.rank) + " (world " +
                           std::to_string(request.world) + ") at step " +
                           std::to_string(request.step) + " from the keeper at " + request.endpoint;
  try {
    Fd sock = connectKeeper(request.endpoint, timeout);
    snapshot::writeFrame(sock.get(),
                         json{{"op", "get"},
                              {"run", request.runId},
                              {"rank", request.rank},
                              {"world", request.world},
                              {"step", request.step},
                              {"mac", snapshot::getMac(request.token, request.runId, request.rank,
                                                       request.world, request.step)}}
                             .dump());
    const auto text = snapshot::readFrame(sock.get(), "the keeper");
    if (!text) throw Error("the keeper closed the stream (a keeper of another job?)");
    const json answer = json::parse(*text, nullptr, false);
    if (!answer.is_object() || !answer.value("ok", false)) {
      throw Error(answer.is_object() ? answer.value("error", std::string("refused"))
                                     : std::string("a malformed reply"));
    }
    const auto bytes = answer.value("bytes", std::uint64_t{0});
    if (bytes < snapshot::kPrefixBytes || bytes > kMaxPieceBytes) {
      throw ProtocolError("a piece of " + std::to_string(bytes) + " bytes cannot be one");
    }
    Fd piece =
        snapshot::createMemfd("fsdprun-fetched-snapshot-r" + std::to_string(request.rank), bytes);
    void* map = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, piece.get(), 0);
    if (map == MAP_FAILED) throwErrno("mapping " + std::to_string(bytes) + " bytes", errno);
    std::unique_ptr<void, std::function<void(void*)>> unmap(
        map, [bytes](void* m) { ::munmap(m, bytes); });
    if (!snapshot::readAll(sock.get(), map, bytes))
      throw Error("the keeper closed the stream mid-piece");
    unmap.reset();  // no writable mapping may remain when sealing against writes
    snapshot::sealPiece(piece.get(), /*writes=*/true);
    return piece;
  } catch (const NetworkError&) {
    throw;  // it names the endpoint
  } catch (const ConfigError& e) {
    throw ConfigError(what + ": " + e.what());
  } catch (const std::exception& e) {
    throw Error(what + " failed after at most " + std::to_string(timeout.count()) +
                " ms per read: " + e.what());
  }
}

}  // namespace fsdp::worker::detail
