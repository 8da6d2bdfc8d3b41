// The agent's snapshot keeper (see snapshot_keeper.hpp): a poll thread serves this node's
// workers on the Unix socket and accepts TCP streams; each TCP stream (a peer pushing pieces, or
// a restoring worker of another node fetching one) is served on its own thread (a piece is
// megabytes; the workers' small requests must not wait behind it).
#include "fsdp/launcher/snapshot_keeper.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <tuple>
#include <vector>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/common/sha256.hpp"
#include "fsdp/common/snapshot_wire.hpp"
#include "unheld_memory.hpp"

namespace fsdp::launcher {

using nlohmann::json;
using snapshot::Fd;

namespace {

constexpr int kKeepLocal = 3;
constexpr int kKeepPeer = 2;

struct Piece {
  Fd fd;
  int rank = 0;
  int world = 0;
  std::int64_t step = 0;
  int round = 0;
  std::uint64_t bytes = 0;
  bool peer = false;
  pid_t owner = 0;  // the worker process that put it (0: a peer copy)
  // Copied by each remote get for as long as it sends the piece: while copies live, its memory
  // must not be written again (neither handed back nor named free to its rank).
  std::shared_ptr<const bool> sending = std::make_shared<const bool>(true);
};

bool beingSent(const Piece& p) { return p.sending.use_count() > 1; }

std::string describe(const Piece& p) {
  return std::string(p.peer ? "peer " : "") + "snapshot of rank " + std::to_string(p.rank) + " (world " +
         std::to_string(p.world) + ") at step " + std::to_string(p.step) + ", " + std::to_string(p.bytes) + " bytes";
}

}  // namespace

std::uint64_t parseByteSize(const std::string& text, const std::string& flag) {
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string suffix = used == 0 ? "" : text.substr(used);
  double scale = 0;
  if (suffix.empty() || suffix == "B") scale = 1;
  if (suffix == "K" || suffix == "KiB" || suffix == "k") scale = 1024.0;
  if (suffix == "M" || suffix == "MiB") scale = 1024.0 * 1024;
  if (suffix == "G" || suffix == "GiB") scale = 1024.0 * 1024 * 1024;
  if (suffix == "T" || suffix == "TiB") scale = 1024.0 * 1024 * 1024 * 1024;
  if (used == 0 || scale == 0 || value < 0 || !std::isfinite(value)) {
    throw ConfigError(flag + " '" + text + "': expected a size such as 512M, 4G or 0 (bytes; K, M, G, T are powers of 1024)");
  }
  return static_cast<std::uint64_t>(value * scale);
}

struct SnapshotKeeper::Impl {
  KeeperOptions options;
  std::string name;
  Fd unixListener;
  Fd tcpListener;
  Fd wake;
  int tcpPort = 0;
  std::thread loop;
  std::atomic<bool> stopping{false};

  mutable std::mutex mutex;  // guards everything below
  std::list<Piece> pieces;
  std::uint64_t held = 0;
  detail::UnheldMemory unheld;  // what the table let go of this node's pieces
  int newestRound = 0;
  int refused = 0;
  std::map<int, KeeperStats::Newest> newest;  // local pieces only
  struct Stream {
    Fd fd;
    std::thread thread;
    std::atomic<bool> done{false};
  };
  std::list<Stream> streams;

  // ---- the table ---------------------------------------------------------------------------

  // Dropped pieces that a remote get still sends: their ranks must not write them yet.
  std::list<Piece> leaving;

  void drop(std::list<Piece>::iterator it) {
    held -= it->bytes;
    if (beingSent(*it)) {
      leaving.splice(leaving.end(), pieces, it);
    } else {
      if (!it->peer) unheld.keep(std::move(it->fd), {it->rank, it->world, it->step, it->bytes, it->owner});
      pieces.erase(it);
    }
  }

  // Takes a piece in, or says why not.
  std::string admit(Piece p) {
    std::scoped_lock lock(mutex);
    if (p.round < newestRound) {
      // A late piece of a round that is over (a stream that finished after the restart).
      return "the " + describe(p) + " is from round " + std::to_string(p.round) + ", older than round " +
             std::to_string(newestRound);
    }
    newestRound = p.round;
    for (auto it = pieces.begin(); it != pieces.end();) {
      const bool otherWorld = it->world != p.world;
      // The same rank at this step or later: another trajectory (a resume from further back).
      const bool superseded = it->rank == p.rank && it->peer == p.peer && it->step >= p.step;
      // Any rank's piece of an older round at this step or later: this round resumed from before
      // it, so that piece lies on the trajectory it left (redone steps need not be the same bits:
      // nondeterministic kernels), and a restore must not mix it with this round's.
      const bool abandoned = it->round < p.round && it->step >= p.step;
      auto next = std::next(it);
      if (otherWorld || superseded || abandoned) drop(it);
      it = next;
    }
    unheld.keepOnly(p.world);
    const int keep = p.peer ? kKeepPeer : kKeepLocal;
    for (;;) {
      int count = 0;
      auto oldest = pieces.end();
      for (auto it = pieces.begin(); it != pieces.end(); ++it) {
        if (it->rank != p.rank || it->peer != p.peer) continue;
        ++count;
        if (oldest == pieces.end() || it->step < oldest->step) oldest = it;
      }
      if (count < keep) break;
      drop(oldest);
    }
    // Only older pieces may make room, and only if that is enough: a piece that cannot fit
    // leaves the other ranks' pieces alone.
    std::uint64_t older = 0;
    for (const auto& q : pieces) {
      if (q.step < p.step) older += q.bytes;
    }
    if (held - older + p.bytes > options.memoryLimit) {
      ++refused;
      // What this rank left is older than what it just sent: useless for a restart now.
      for (auto it = pieces.begin(); it != pieces.end();) {
        auto next = std::next(it);
        if (it->rank == p.rank && it->peer == p.peer) drop(it);
        it = next;
      }
      return "the " + describe(p) + " does not fit this node's snapshot memory limit (--snapshot_memory_limit " +
             std::to_string(options.memoryLimit) + " bytes, " + std::to_string(held) + " held)";
    }
    while (held + p.bytes > options.memoryLimit) {
      auto oldest = pieces.end();
      for (auto it = pieces.begin(); it != pieces.end(); ++it) {
        if (it->step < p.step && (oldest == pieces.end() || it->step < oldest->step)) oldest = it;
      }
      drop(oldest);
    }
    held += p.bytes;
    if (!p.peer) newest[p.rank] = {p.step, std::chrono::system_clock::now()};
    log::debug("snapshot keeper: holding the {}", describe(p));
    pieces.push_back(std::move(p));
    return "";
  }

  // Checks a piece's prefix; what the piece is (rank, world, step, round) comes from `names`: a
  // worker's put names it (parsing its header, a large table for a big model, cost this process
  // a third of a millisecond every step), a peer stream's piece from its header.
  static Piece inspect(Fd fd, bool peer, const json& names) {
    Piece p;
    snapshot::checkPiecePrefix(fd.get(), "the piece handed over");
    for (const char* key : {"rank", "world", "step", "round"}) {
      if (!names.contains(key) || !names[key].is_number_integer()) {
        throw Error("a put names its piece's rank, world, step and round (integers); " + std::string(key) + " is " +
                    (names.contains(key) ? names[key].dump() : std::string("missing")));
      }
    }
    p.rank = names.at("rank").get<int>();
    p.world = names.at("world").get<int>();
    p.step = names.at("step").get<std::int64_t>();
    p.round = names.at("round").get<int>();
    p.bytes = snapshot::fileBytes(fd.get());
    p.peer = peer;
    if (p.world < 1 || p.rank < 0 || p.rank >= p.world || p.step < 0) throw Error("a piece names rank " + std::to_string(p.rank) + " of world " + std::to_string(p.world));
    p.fd = std::move(fd);
    return p;
  }

  // ---- the Unix socket -------------------------------------------------------------------

  std::string serve(const std::string& text, Fd passed, int sock) {
    json request = json::parse(text, nullptr, false);
    if (!request.is_object()) return json{{"ok", false}, {"error", "malformed request"}}.dump();
    const std::string op = request.value("op", "");
    if (op == "put") {
      if (!passed) return json{{"ok", false}, {"error", "a put carries no piece"}}.dump();
      if (!snapshot::isSealed(passed.get())) {
        return json{{"ok", false}, {"error", "a piece must be sealed against growing and shrinking"}}.dump();
      }
      int rank = -1;
      try {
        Piece p = inspect(std::move(passed), false, request);
        rank = p.rank;
        ucred cred{};
        socklen_t length = sizeof(cred);
        if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &length) == 0) p.owner = cred.pid;
        const std::string error = admit(std::move(p));
        if (!error.empty()) return json{{"ok", false}, {"error", error}}.dump();
      } catch (const std::exception& e) {
        return json{{"ok", false}, {"error", e.what()}}.dump();
      }
      // The steps of this rank still held (or still being sent): the worker may write into the
      // memory of any other.
      std::scoped_lock lock(mutex);
      leaving.remove_if([](const Piece& p) { return !beingSent(p); });
      json held = json::array();
      for (const auto* list : {&pieces, &leaving}) {
        for (const auto& p : *list) {
          if (p.rank == rank && !p.peer) held.push_back(p.step);
        }
      }
      return json{{"ok", true}, {"held", held}}.dump();
    }
    if (op == "list") {
      std::scoped_lock lock(mutex);
      json list = json::array();
      for (const auto& p : pieces) {
        list.push_back({{"rank", p.rank},
                        {"world", p.world},
                        {"step", p.step},
                        {"round", p.round},
                        {"bytes", p.bytes},
                        {"peer", p.peer}});
      }
      return json{{"ok", true}, {"pieces", list}}.dump();
    }
    if (op == "get") {
      std::scoped_lock lock(mutex);
      const Piece* found = nullptr;  // its own piece rather than a peer copy of it
      for (const auto& p : pieces) {
        if (p.rank == request.value("rank", -1) && p.world == request.value("world", -1) &&
            p.step == request.value("step", std::int64_t{-1}) && (found == nullptr || !p.peer)) {
          found = &p;
        }
      }
      if (found == nullptr) return json{{"ok", false}, {"error", "no such piece"}}.dump();
      snapshot::sendMessage(sock, json{{"ok", true}, {"peer", found->peer}}.dump(), found->fd.get());
      return "";
    }
    if (op == "recycle") {
      // A rank that restored step `before` takes back the memory of the piece its next put would
      // drop anyway (the oldest of kKeepLocal, older than `before`), for that next snapshot. The
      // others stay: a failure before that put may still need to fall back to them.
      const auto integer = [&request](const char* key) {
        const auto it = request.find(key);
        return it != request.end() && it->is_number_integer() ? it->get<std::int64_t>() : std::int64_t{-1};
      };
      const std::int64_t rank = integer("rank");
      const std::int64_t world = integer("world");
      std::scoped_lock lock(mutex);
      // First the buffer its dead predecessor wrote last, which holds no snapshot: the table's
      // pieces all stay for a fallback.
      auto [memory, was] = unheld.take(static_cast<int>(rank), static_cast<int>(world), [this](dev_t dev, ino_t ino) {
        for (const auto* list : {&pieces, &leaving}) {
          for (const auto& p : *list) {
            struct stat st {};
            if (::fstat(p.fd.get(), &st) == 0 && st.st_dev == dev && st.st_ino == ino) return true;
          }
        }
        return false;
      });
      if (memory) {
        Piece what;
        std::tie(what.rank, what.world, what.step, what.bytes) = std::tie(was.rank, was.world, was.step, was.bytes);
        log::debug("snapshot keeper: the {} goes back to its rank for reuse (its writer has exited)", describe(what));
        snapshot::sendMessage(sock, json{{"ok", true}, {"step", was.step}, {"unheld", true}}.dump(), memory.get());
        return "";
      }
      auto oldest = pieces.end();
      std::int64_t newestStep = -1;
      int count = 0;
      for (auto it = pieces.begin(); it != pieces.end(); ++it) {
        if (it->rank != rank || it->world != world || it->peer) continue;
        ++count;
        newestStep = std::max(newestStep, it->step);
        if (oldest == pieces.end() || it->step < oldest->step) oldest = it;
      }
      const auto before = std::min(integer("before"), newestStep);
      if (count < kKeepLocal || oldest->step >= before || beingSent(*oldest)) {
        return json{{"ok", false}, {"error", "none to spare"}}.dump();
      }
      Fd fd = std::move(oldest->fd);
      const json answer{{"ok", true}, {"step", oldest->step}};
      log::debug("snapshot keeper: the {} goes back to its rank for reuse", describe(*oldest));
      drop(oldest);
      snapshot::sendMessage(sock, answer.dump(), fd.get());
      return "";
    }
    return json{{"ok", false}, {"error", "unknown op '" + op + "'"}}.dump();
  }

  // ---- peer streams ----------------------------------------------------------------------

  void reply(int fd, const json& answer) { snapshot::writeFrame(fd, answer.dump()); }

  // A remote get: the piece's bytes straight from its memfd. A request that is not from this
  // job (run id, MAC) throws and so closes the stream; a piece not held is an answer.
  void serveGet(int fd, const json& header, const std::string& peerName) {
    const int rank = header.at("rank").get<int>();
    const int world = header.at("world").get<int>();
    const auto step = header.at("step").get<std::int64_t>();
    const std::string mac = header.at("mac").get<std::string>();
    if (header.at("run").get<std::string>() != options.runId ||
        !constantTimeEqual(mac, snapshot::getMac(options.token, options.runId, rank, world, step))) {
      throw ProtocolError("a get from outside this job (run id or MAC)");
    }
    Fd piece;
    std::shared_ptr<const bool> sending;  // held until the bytes are sent
    std::uint64_t bytes = 0;
    {
      std::scoped_lock lock(mutex);
      // The newest of them: a keeper may hold a rank's own piece and a peer copy of it.
      for (const auto& p : pieces) {
        if (p.rank == rank && p.world == world && p.step == step && (!piece || !p.peer)) {
          // A descriptor of its own: the piece may be dropped while it is being sent.
          piece = Fd(::fcntl(p.fd.get(), F_DUPFD_CLOEXEC, 0));
          if (!piece) throwErrno("duplicating a snapshot descriptor", errno);
          sending = p.sending;
          bytes = p.bytes;
        }
      }
    }
    if (!piece) {
      reply(fd, {{"ok", false},
                 {"error", "no snapshot of rank " + std::to_string(rank) + " (world " + std::to_string(world) +
                               ") at step " + std::to_string(step) + " is held here"}});
      return;
    }
    reply(fd, {{"ok", true}, {"bytes", bytes}});
    off_t from = 0;
    while (static_cast<std::uint64_t>(from) < bytes) {
      const ssize_t n = ::sendfile(fd, piece.get(), &from, bytes - static_cast<std::uint64_t>(from));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        throwErrno("sending the snapshot of rank " + std::to_string(rank) + " at step " + std::to_string(step),
                   errno);
      }
    }
    log::debug("snapshot keeper: sent the snapshot of rank {} (world {}) at step {} to {}", rank, world, step,
               peerName);
  }

  void readStream(int fd) {
    std::string peerName = "the snapshot stream from ";
    sockaddr_in from{};
    socklen_t fromLength = sizeof(from);
    char address[INET_ADDRSTRLEN] = "?";
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&from), &fromLength) == 0) {
      ::inet_ntop(AF_INET, &from.sin_addr, address, sizeof(address));
      peerName += std::string(address) + ":" + std::to_string(ntohs(from.sin_port));
    }
    try {
      for (;;) {
        // Between pieces a stream may idle as long as a training step takes; within one, the
        // read timeout (a minute without a byte) ends it.
        pollfd ready{fd, POLLIN, 0};
        while (::poll(&ready, 1, -1) < 0 && errno == EINTR) {
        }
        const auto text = snapshot::readFrame(fd, "it");
        if (!text) return;
        const json header = json::parse(*text);
        // No "op": a put (the peer streams of workers that predate remote gets).
        const std::string op = header.contains("op") ? header.at("op").get<std::string>() : "put";
        if (op == "get") {
          serveGet(fd, header, peerName);
          continue;
        }
        if (op != "put") throw ProtocolError("unknown op '" + op + "'");
        const int rank = header.at("rank").get<int>();
        const int world = header.at("world").get<int>();
        const auto step = header.at("step").get<std::int64_t>();
        const auto bytes = header.at("bytes").get<std::uint64_t>();
        const std::string mac = header.at("mac").get<std::string>();
        if (header.at("run").get<std::string>() != options.runId ||
            !constantTimeEqual(mac, snapshot::peerMac(options.token, options.runId, rank, world, step, bytes))) {
          throw ProtocolError("a put from outside this job (run id or MAC)");
        }
        if (bytes > options.memoryLimit || bytes < snapshot::kPrefixBytes) {
          // Read nothing more: the stream cannot be followed past a piece not taken.
          reply(fd, {{"ok", false}, {"error", "a piece of " + std::to_string(bytes) + " bytes exceeds the peer's snapshot memory limit"}});
          return;
        }
        Fd memfd = snapshot::createMemfd("fsdprun-peer-snapshot", bytes);
        void* map = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.get(), 0);
        if (map == MAP_FAILED) throwErrno("mapping a peer snapshot", errno);
        std::unique_ptr<void, std::function<void(void*)>> unmap(map, [bytes](void* m) { ::munmap(m, bytes); });
        if (!snapshot::readAll(fd, map, bytes)) return;
        unmap.reset();  // no writable mapping may remain when sealing against writes
        snapshot::sealPiece(memfd.get(), /*writes=*/true);
        std::string error;
        try {
          const json header = json::parse(snapshot::readPieceHeader(memfd.get(), "the peer piece"));
          Piece p = inspect(std::move(memfd), true, {{"rank", header.at("rank")}, {"world", header.at("world")},
                                                     {"step", header.at("step")}, {"round", header.value("round", 0)}});
          if (p.rank != rank || p.world != world || p.step != step) throw Error("its header does not match its stream header");
          error = admit(std::move(p));
        } catch (const std::exception& e) {
          error = std::string("a peer piece was refused: ") + e.what();
        }
        if (!error.empty()) log::warn("snapshot keeper: {}", error);
        reply(fd, error.empty() ? json{{"ok", true}} : json{{"ok", false}, {"error", error}});
      }
    } catch (const std::exception& e) {
      if (!stopping) log::warn("snapshot keeper: closed {}: {}", peerName, e.what());
    }
  }

  // A peer stream gets a thread of its own, up to kMaxStreams at once; a stream that sends
  // nothing for a minute is closed (a node that died mid-piece).
  static constexpr std::size_t kMaxStreams = 64;
  void acceptStream(Fd c) {
    std::scoped_lock lock(mutex);
    std::erase_if(streams, [](Stream& s) {
      if (!s.done) return false;
      s.thread.join();
      return true;
    });
    if (streams.size() >= kMaxStreams) {
      log::warn("snapshot keeper: {} peer streams open already; refusing another", streams.size());
      return;
    }
    timeval tv{.tv_sec = 60, .tv_usec = 0};
    ::setsockopt(c.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(c.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    const int one = 1;  // replies and a piece's last bytes go at once, not after a delayed ACK
    ::setsockopt(c.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto& s = streams.emplace_back();
    s.fd = std::move(c);
    try {
      s.thread = std::thread([this, &s] {
        readStream(s.fd.get());
        ::shutdown(s.fd.get(), SHUT_RDWR);  // the sender learns at once; the fd goes at the next accept
        s.done = true;
      });
    } catch (const std::system_error& e) {
      log::warn("snapshot keeper: no thread for a peer stream: {}", e.what());
      streams.pop_back();
    }
  }

  // ---- the loop ----------------------------------------------------------------------------

  void run() {
    struct Client {
      Fd fd;
    };
    std::list<Client> clients;
    while (!stopping) {
      std::vector<pollfd> fds = {{wake.get(), POLLIN, 0}, {unixListener.get(), POLLIN, 0},
                                 {tcpListener.get(), POLLIN, 0}};
      for (const auto& c : clients) fds.push_back({c.fd.get(), POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 1000) < 0 && errno != EINTR) {
        log::error("snapshot keeper: poll failed: {}", std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      if (stopping) break;
      if ((fds[1].revents & POLLIN) != 0) {
        Fd c(::accept4(unixListener.get(), nullptr, nullptr, SOCK_CLOEXEC));
        ucred cred{};
        socklen_t length = sizeof(cred);
        if (c && ::getsockopt(c.get(), SOL_SOCKET, SO_PEERCRED, &cred, &length) == 0 && cred.uid == ::getuid()) {
          clients.push_back({std::move(c)});
        }
      }
      if ((fds[2].revents & POLLIN) != 0) {
        Fd c(::accept4(tcpListener.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (!c && (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS)) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));  // not a busy loop
        }
        if (c) acceptStream(std::move(c));
      }
      auto it = clients.begin();
      for (std::size_t i = 3; i < fds.size(); ++i, ++it) {
        if (fds[i].revents == 0) continue;
        bool keep = false;
        try {
          if (auto message = snapshot::receiveMessage(it->fd.get())) {
            const std::string answer = serve(message->first, std::move(message->second), it->fd.get());
            if (!answer.empty()) snapshot::sendMessage(it->fd.get(), answer);
            keep = true;
          }
        } catch (const std::exception& e) {
          log::warn("snapshot keeper: closed a worker's connection: {}", e.what());
        }
        if (!keep) it->fd.reset();
      }
      clients.remove_if([](const Client& c) { return !c.fd; });
    }
  }
};

SnapshotKeeper::SnapshotKeeper(KeeperOptions options) : impl_(std::make_unique<Impl>()) {
  auto& d = *impl_;
  d.options = std::move(options);
  d.name = "fsdprun-snapshots-" + std::to_string(::getpid()) + "-" + toHex(randomBytes(6));
  d.unixListener = Fd(snapshot::listenSeqpacket(d.name));
  d.wake = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!d.wake) throwErrno("eventfd", errno);

  Fd tcp(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!tcp) throwErrno("socket for peer snapshots", errno);
  const int one = 1;
  ::setsockopt(tcp.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (::inet_pton(AF_INET, d.options.listenAddress.c_str(), &addr.sin_addr) != 1) {
    throw ConfigError("snapshot keeper: '" + d.options.listenAddress + "' is not an IPv4 address");
  }
  if (::bind(tcp.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    throwErrno("binding the peer snapshot port on " + d.options.listenAddress, errno);
  }
  if (::listen(tcp.get(), 16) != 0) throwErrno("listen for peer snapshots", errno);
  socklen_t length = sizeof(addr);
  ::getsockname(tcp.get(), reinterpret_cast<sockaddr*>(&addr), &length);
  d.tcpPort = ntohs(addr.sin_port);
  d.tcpListener = std::move(tcp);
  d.loop = std::thread([&d] { d.run(); });
}

SnapshotKeeper::~SnapshotKeeper() {
  auto& d = *impl_;
  d.stopping = true;
  const std::uint64_t one = 1;
  [[maybe_unused]] const auto n = ::write(d.wake.get(), &one, sizeof(one));
  if (d.loop.joinable()) d.loop.join();
  std::list<Impl::Stream> streams;
  {
    std::scoped_lock lock(d.mutex);
    streams.swap(d.streams);
  }
  for (auto& s : streams) ::shutdown(s.fd.get(), SHUT_RDWR);
  for (auto& s : streams) {
    if (s.thread.joinable()) s.thread.join();
  }
}

const std::string& SnapshotKeeper::socketName() const { return impl_->name; }

std::string SnapshotKeeper::peerEndpoint() const {
  return impl_->options.listenAddress + ":" + std::to_string(impl_->tcpPort);
}

KeeperStats SnapshotKeeper::stats() const {
  std::scoped_lock lock(impl_->mutex);
  return {impl_->held, static_cast<int>(impl_->pieces.size()), impl_->refused, impl_->newest, impl_->unheld.bytes()};
}

}  // namespace fsdp::launcher
