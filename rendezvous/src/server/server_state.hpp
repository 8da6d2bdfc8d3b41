#pragma once
// The store server's event-loop state: its runs, the logical clients (streams), the server
// itself (StoreServer::Impl) and one connection (Session). Private to the server's files:
//   outbox.cpp    what a connection sends: held replies, the write queue, its byte cap
//   session.cpp   what a connection reads: framing, the dialect, multiplexed streams
//   requests.cpp  request routing, the handshake (HELLO/AUTH) and parked operations
//   runs.cpp      the run registry, round timers and event delivery
//   ../store_server.cpp  accepting, starting and stopping

#include <boost/asio.hpp>
#include <deque>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "fsdp/rendezvous/kv_store.hpp"
#include "fsdp/rendezvous/round.hpp"
#include "fsdp/rendezvous/store_server.hpp"

namespace fsdp::rendezvous {

namespace detail {
namespace asio = boost::asio;
using TimePoint = asio::steady_timer::clock_type::time_point;
}  // namespace detail

// "host:port" of a socket's peer, for messages only.
std::string peerName(const boost::asio::ip::tcp::socket& socket);

// Logs what ended a coroutine spawned on the loop (co_spawn's completion handler).
void logCoroutineError(const char* what, std::exception_ptr e);

struct Run {
  std::string id;
  KvStore store;
  StoreService service{store};
  RoundState rounds;
  std::size_t sessions = 0;
  detail::TimePoint lastActive;
  std::unique_ptr<boost::asio::steady_timer> tick;
  bool dropped = false;
};

class Session;

// One logical client: a connection's own (stream 0), or one stream of a multiplexed
// connection (a node's store proxy), with its own handshake, run and parked request.
struct Stream {
  Stream(const boost::asio::any_io_executor& executor, std::uint16_t number)
      : parked(executor), number(number) {}
  boost::asio::steady_timer parked;  // a waiting request sleeps here until woken or timed out
  std::uint16_t number;
  Run* run = nullptr;
  std::string runId;
  std::string clientNonce;
  std::string serverNonce;
  bool authenticated = false;
  bool joined = false;
  bool ended = false;            // its client went away, or the server ended it
  bool busy = false;             // multiplexed: a handler is working through `queue`
  // Multiplexed: requests read and not handled yet, in order, with their frames' sizes, and
  // the sum of those (bounded by ServerOptions::maxQueuedBytes).
  std::deque<std::pair<Request, std::size_t>> queue;
  std::size_t queuedBytes = 0;
};

struct StoreServer::Impl {
  // Declared before io so that they outlive it: the coroutines still suspended when the server
  // stops are destroyed with io, and their cleanup unregisters watches from their run's store.
  // (Each run's timer, bound to io, is freed before io in ~Impl.)
  std::unordered_map<std::string, std::unique_ptr<Run>> runs;
  ServerOptions options;
  bool allowPytorch = true;
  boost::asio::io_context io{1};
  boost::asio::ip::tcp::acceptor acceptor{io};
  boost::asio::steady_timer sweep{io};
  ServerStats stats;
  std::size_t queuedBytes = 0;  // what every session's outbox holds
  std::set<AgentId> stalled;    // sessions whose readers wait for their clients to read
  // Wakes every stalled session's reader to re-check (the server-wide cap was left).
  void wakeStalled();
  std::unordered_map<AgentId, Session*> sessions;
  AgentId nextSession = 1;
  std::thread thread;
  bool stopped = false;

  ~Impl() {
    for (auto& [id, run] : runs) run->tick.reset();
  }
  boost::asio::awaitable<void> accept();
  boost::asio::awaitable<void> sweepRuns();
  boost::asio::awaitable<void> tickRun(Run* run);
  Run& bindRun(const std::string& id);
  void rearm(Run& run);
  void deliver(Run& run, const std::vector<Event>& events);
};

// One connection. Reads requests in order; writes replies and pushed events through one
// outbox, so that events from other sessions never interleave with a half-written frame.
// What it has queued and not written is bounded (ServerOptions::maxQueuedBytes): over the
// bound it stops reading its client until the client reads (back-pressure), and a client that
// reads nothing for frameTimeout is closed, logged.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(StoreServer::Impl& server, boost::asio::ip::tcp::socket socket);

  boost::asio::awaitable<void> run();

  // Sends a frame. While this session's reader handles the frames it has read, replies are
  // held and leave together when it waits again (a HELLO pipelined with a request: one
  // segment back, one wake-up of the client); anything sent while it is parked leaves at
  // once, held replies first.
  void send(std::vector<std::uint8_t> frame);
  // Sends what the reader held; from now on, sends leave at once.
  void release();
  // Closes once everything queued has been written.
  void closeAfterFlush();
  void close();
  // Makes a reader that waits for its client to read re-check now.
  void wakeRoom();

  AgentId id() const { return id_; }
  bool writing() const { return writing_; }

 private:
  // --- outbox.cpp
  void write(std::vector<std::uint8_t> frame);
  boost::asio::awaitable<void> writer(std::shared_ptr<Session> self);
  // Bytes sent and not written yet (held and queued).
  std::size_t unsentBytes() const { return held_.size() + queuedBytes_; }
  // Whether the reader must wait for its client to read: over this connection's cap, or with
  // something unread while the server as a whole is over its own.
  bool overCap() const;
  void queue(std::vector<std::uint8_t> frame);
  void dequeue();
  // Back-pressure: returns once what this connection has not written is under the cap;
  // false (the connection closed) when the client reads nothing for frameTimeout.
  boost::asio::awaitable<bool> waitForRoom();

  // --- session.cpp
  boost::asio::awaitable<void> reader();
  boost::asio::awaitable<bool> fill(std::size_t n, std::optional<detail::TimePoint> deadline);
  boost::asio::awaitable<void> serveFramed();
  void dispatch(std::uint16_t number, Request req, std::size_t bytes);
  boost::asio::awaitable<void> serveStream(std::shared_ptr<Session> self,
                                           std::shared_ptr<Stream> stream);
  void endStream(Stream& stream);
  void reply(Stream& stream, std::vector<std::uint8_t> frame);
  void finish();
  std::string peer() const;
  std::string what(const Stream& s) const;

  // --- requests.cpp
  boost::asio::awaitable<bool> handleFramed(Stream& s, const Request& req);
  // HELLO and AUTH; false when the stream must end after its error reply.
  bool handshake(Stream& s, const Request& req);
  boost::asio::awaitable<Response> addWait(Stream& s, Run& run, const Request& req);
  boost::asio::awaitable<Response> answer(Stream& s, Run& run, const Request& req);
  void bind(Stream& s);
  void unbind(Stream& s);
  // A request is about to wait: events pushed meanwhile leave at once, with what an ordinary
  // connection's reader held (a HELLO reply goes with its request's, the usual case).
  void park() { holding_ = false; }

  StoreServer::Impl& server_;
  boost::asio::ip::tcp::socket socket_;
  std::shared_ptr<Stream> main_;  // the connection's own client
  // Multiplexed (after MUX): the streams by number, and whether a flush of held_ is posted.
  std::unordered_map<std::uint16_t, std::shared_ptr<Stream>> streams_;
  bool mux_ = false;
  bool flushPosted_ = false;
  AgentId id_;
  // Frames the socket did not take at once (a slow reader). A vector rather than a deque,
  // which would allocate 576 bytes up front for every connection.
  std::vector<std::vector<std::uint8_t>> outbox_;
  std::size_t queuedBytes_ = 0;  // what outbox_ holds
  // The reader waits here for the writer to bring the unsent bytes under the cap.
  std::unique_ptr<boost::asio::steady_timer> room_;
  static constexpr int kRequestsPerTurn = 16;
  int sinceYield_ = 0;  // requests read since this connection last let others run
  bool closed_ = false;
  bool closeAfterFlush_ = false;
  bool writing_ = false;
  bool holding_ = false;  // the reader is handling what it read: replies wait in held_
  std::vector<std::uint8_t> held_;
  // Received bytes; [inStart_, inEnd_) not parsed yet. Small at first: a fresh server's
  // first thousands of connections pay a page fault for every 4 KiB they touch, and most
  // clients send a frame or two of a few dozen bytes.
  static constexpr std::size_t kMaxReadSize = 64 * 1024;
  std::size_t readSize_ = 512;
  std::vector<std::uint8_t> in_;
  std::size_t inStart_ = 0;
  std::size_t inEnd_ = 0;
};

}  // namespace fsdp::rendezvous
