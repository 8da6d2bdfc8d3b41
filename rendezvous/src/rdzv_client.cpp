#include "fsdp/rendezvous/rdzv_client.hpp"

#include <arpa/inet.h>
#include <cerrno>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include "connection.hpp"

namespace fsdp::rendezvous {

std::unique_ptr<RendezvousClient> RendezvousClient::connect(const std::string& host,
                                                            std::uint16_t port,
                                                            const ClientOptions& options) {
  auto connection = detail::Connection::open(host, port, options);
  try {
    connection.completeHandshake(Deadline::after(options.connectTimeout));
  } catch (const TimeoutError&) {
    throw HandshakeTimeout("rendezvous endpoint " + connection.endpoint() +
                       " accepted the connection but did not answer fsdprun's handshake within " +
                       std::to_string(options.connectTimeout.count()) + " ms (another service on that port?)");
  }
  return std::unique_ptr<RendezvousClient>(
      new RendezvousClient(std::make_unique<detail::Connection>(std::move(connection))));
}

RendezvousClient::RendezvousClient(std::unique_ptr<detail::Connection> connection)
    : connection_(std::move(connection)) {}

RendezvousClient::~RendezvousClient() = default;

int RendezvousClient::fd() const { return connection_->fd(); }

bool RendezvousClient::hasBufferedEvent() const { return connection_->buffered(); }

const std::string& RendezvousClient::endpoint() const { return connection_->endpoint(); }

std::string RendezvousClient::localAddress() const {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getsockname(connection_->fd(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throwErrno("getsockname on the rendezvous connection", errno);
  }
  char text[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
      ::inet_ntop(AF_INET, &in6->sin6_addr.s6_addr[12], text, sizeof(text));
    } else {
      ::inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text));
    }
  } else {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&addr)->sin_addr, text, sizeof(text));
  }
  return text;
}

Assignment RendezvousClient::join(const JoinRequest& request, std::chrono::milliseconds timeout) {
  const auto start = Deadline::Clock::now();
  const Deadline deadline = Deadline::after(timeout);
  connection_->send(encodeRequest({.op = Op::kJoin, .value = encodeJoin(request)}), deadline);
  for (;;) {
    std::optional<RendezvousEvent> event;
    try {
      event = nextEvent(deadline.remaining());
    } catch (const TimeoutError&) {
      event.reset();
    }
    if (!event) {
      throw TimeoutError("rendezvous: node " + request.node + " got no assignment from " +
                         endpoint() + " after " + std::to_string(elapsedMs(start)) + " ms (needs " +
                         std::to_string(request.minNodes) + " to " + std::to_string(request.maxNodes) +
                         " nodes)");
    }
    switch (event->kind) {
      case EventKind::kAssigned: return event->assignment;
      case EventKind::kRunClosed:
      case EventKind::kRunFinished:
      case EventKind::kRunFailed: throw RunClosedError("rendezvous: run closed: " + event->reason);
      case EventKind::kJoinFailed:
      case EventKind::kDisconnect:
        throw Error("rendezvous: server " + endpoint() + " refused node " + request.node + ": " +
                    event->reason);
      case EventKind::kRoundEnded: break;  // a stale notice from the previous round
      case EventKind::kSpare: break;       // waits on as a spare
    }
  }
}

void RendezvousClient::sendJoin(const JoinRequest& request) {
  connection_->send(encodeRequest({.op = Op::kJoin, .value = encodeJoin(request)}),
                    Deadline::after(std::chrono::seconds(30)));
}

void RendezvousClient::heartbeat() {
  connection_->send(encodeRequest({.op = Op::kHeartbeat}), Deadline::after(std::chrono::seconds(10)));
}

void RendezvousClient::endRound(const std::string& reason, const std::string& failure) {
  connection_->send(encodeRequest({.op = Op::kEndRound, .value = reason, .value2 = failure}),
                    Deadline::after(std::chrono::seconds(10)));
}

void RendezvousClient::succeeded() {
  connection_->send(encodeRequest({.op = Op::kSucceeded}), Deadline::after(std::chrono::seconds(10)));
}

void RendezvousClient::closeRun(const std::string& reason) {
  connection_->send(encodeRequest({.op = Op::kCloseRun, .value = reason}),
                    Deadline::after(std::chrono::seconds(10)));
}

std::optional<RendezvousEvent> RendezvousClient::nextEvent(std::chrono::milliseconds timeout) {
  if (!connection_->buffered()) {
    pollfd pfd{connection_->fd(), POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(std::min<long long>(timeout.count(), 1 << 30)));
    if (r == 0) return std::nullopt;
    if (r < 0 && errno == EINTR) return std::nullopt;
  }
  auto [header, body] = connection_->receive(Deadline::after(std::chrono::seconds(30)));
  if (header.op != Op::kEvent) {
    throw ProtocolError("rendezvous: server " + endpoint() + " sent " + opName(header.op) +
                        " where an EVENT was expected");
  }
  const Response resp = decodeResponse(body, Limits{});
  if (resp.number < static_cast<int>(EventKind::kAssigned) ||
      resp.number > static_cast<int>(EventKind::kSpare)) {
    throw ProtocolError("rendezvous: server " + endpoint() + " sent an unknown event kind " +
                        std::to_string(resp.number));
  }
  Event decoded;
  decoded.kind = static_cast<EventKind>(resp.number);
  decodeEventPayload(resp.value, decoded);
  return RendezvousEvent{decoded.kind, decoded.assignment, decoded.reason, decoded.failure};
}

}  // namespace fsdp::rendezvous
