// The client side of rdzv_join and store_init: the hidden subcommands fsdp-bench runs in its
// child processes (scale.cpp starts and drives them). Each client process connects its share
// of the clients first, prints "ready", waits for "go" on stdin, runs the workload and prints
// its first-start and last-finish CLOCK_MONOTONIC times. Also c10d's TCPStore server, in a
// process of its own like fsdprun-rdzv.
#include <sys/epoll.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <iostream>
#include <latch>
#include <mutex>
#include <optional>
#include <thread>

#include "bench.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/rendezvous/protocol.hpp"
#include "fsdp/rendezvous/rdzv_client.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/rendezvous/store_proxy.hpp"

namespace fsdp::bench {
namespace {

using Clock = std::chrono::steady_clock;

long long nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

}  // namespace

// Hidden: one process's share of rdzv_join agents.
int rdzvJoinHelper(std::uint16_t port, int count, int total) {
  raiseDescriptorLimit();
  std::vector<std::unique_ptr<rendezvous::RendezvousClient>> agents;
  agents.reserve(static_cast<std::size_t>(count));
  const auto pid = std::to_string(::getpid());
  for (int i = 0; i < count; ++i) {
    agents.push_back(rendezvous::RendezvousClient::connect("127.0.0.1", port, {.connectTimeout = std::chrono::seconds(60), .runId = "bench"}));
  }
  std::cout << "ready" << std::endl;
  std::string go;
  std::getline(std::cin, go);
  const long long first = nowNs();
  for (int i = 0; i < count; ++i) {
    rendezvous::JoinRequest join;
    join.node = "agent-" + pid + "-" + std::to_string(i);
    join.address = "127.0.0.1";
    join.minNodes = total;
    join.maxNodes = total;
    join.joinTimeout = std::chrono::seconds(120);
    join.heartbeatTimeout = std::chrono::seconds(120);
    agents[static_cast<std::size_t>(i)]->sendJoin(join);
  }
  std::vector<pollfd> fds;
  for (auto& a : agents) fds.push_back({a->fd(), POLLIN, 0});
  int pending = count;
  while (pending > 0) {
    if (::poll(fds.data(), fds.size(), 60000) <= 0) throw TimeoutError("rdzv_join: assignments did not come");
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & POLLIN)) continue;
      const auto event = agents[i]->nextEvent(std::chrono::milliseconds(0));
      if (!event || event->kind != rendezvous::EventKind::kAssigned) throw Error("rdzv_join: unexpected event");
      fds[i].fd = -1;
      --pending;
    }
  }
  std::cout << first << " " << nowNs() << std::endl;
  return 0;
}

namespace {

// Touches the next 64 KiB of the calling thread's stack and binds its malloc arena, so that
// the timed part pays no first-touch page faults, which with a thousand threads in one
// process contend on its memory map: the simulator's cost, not the store's.
[[gnu::noinline]] void warmThread() {
  char pad[64 * 1024];
  std::memset(pad, 1, sizeof(pad));
  asm volatile("" : : "r"(pad) : "memory");
  void* volatile block = std::malloc(4096);  // volatile: a malloc/free pair is otherwise elided
  std::free(block);
}

}  // namespace

// Hidden: one process's share of store_init clients, one thread each. The finish time is
// taken before the client closes, and every client keeps its store open until all are done
// (a rank keeps its store for the whole job): a thread exiting inside the timed window would
// unmap its stack and interrupt the other core, and a close would be work for the server.
int storeInitHelper(const std::string& server, std::uint16_t port, int count, int total) {
  raiseDescriptorLimit();
  // Separate rank processes would not share a descriptor table; one shared by a thousand
  // threads must not grow (and stall them all) inside the timed window.
  reserveDescriptorTable(4 * static_cast<std::size_t>(count) + 256);  // c10d's: 2 sockets + a pipe each
  // "proxy": this process is a node whose agent carries its ranks on one server connection.
  std::optional<rendezvous::StoreProxy> proxy;
  if (server == "proxy") {
    proxy.emplace(rendezvous::ProxyOptions{.serverHost = "127.0.0.1", .serverPort = port, .runId = "bench"});
    port = proxy->port();
  }
  std::latch go(1);
  // Not a std::latch: its waiters spin and sched_yield before they sleep, taking the CPU from
  // clients still being served.
  std::mutex doneMutex;
  std::condition_variable allDone;
  int running = count;
  std::atomic<long long> first{std::numeric_limits<long long>::max()};
  std::atomic<long long> last{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < count; ++i) {
    threads.emplace_back([&] {
      warmThread();
      go.wait();
      long long start = nowNs();
      long long expected = first.load();
      while (start < expected && !first.compare_exchange_weak(expected, start)) {
      }
      std::unique_ptr<rendezvous::StoreClient> ours;
      std::optional<c10d::TCPStore> theirs;
      try {
        if (server != "c10d") {
          ours = rendezvous::StoreClient::connect("127.0.0.1", port, {.connectTimeout = std::chrono::seconds(60), .timeout = std::chrono::seconds(120), .runId = "bench"});
          // One request: the server counts and answers everyone when the count reaches N.
          ours->addAndWait("init", 1, total, std::chrono::seconds(120));
        } else {
          c10d::TCPStoreOptions o;
          o.port = port;
          o.isServer = false;
          o.waitWorkers = false;
          o.timeout = std::chrono::seconds(120);
          theirs.emplace("127.0.0.1", o);
          if (theirs->add("init", 1) == total) theirs->set("init/done", {'1'});
          theirs->wait({"init/done"});
        }
      } catch (const std::exception& e) {
        ++failures;
        std::cerr << "store_init client: " << e.what() << std::endl;
      }
      const long long end = nowNs();
      long long seen = last.load();
      while (end > seen && !last.compare_exchange_weak(seen, end)) {
      }
      std::unique_lock lock(doneMutex);
      if (--running == 0) allDone.notify_all();
      allDone.wait(lock, [&] { return running == 0; });
    });
  }
  std::cout << "ready" << std::endl;
  std::string line;
  std::getline(std::cin, line);
  go.count_down();
  for (auto& t : threads) t.join();
  if (failures > 0) {
    std::cout << "failed: " << failures << " clients" << std::endl;
    return 1;
  }
  std::cout << first.load() << " " << last.load() << std::endl;
  return 0;
}

namespace {

// One client of the wire-level store_init: a non-blocking socket driven by its thread's epoll.
struct WireClient {
  int fd = -1;
  int stage = 0;                  // 0 connecting, then what `wire` says
  std::vector<std::uint8_t> in;   // bytes received and not consumed
  long long attemptNs = 0;        // when the current connect attempt started
  long long attemptTimeoutNs = 100'000'000;
};

void appendU64(std::vector<std::uint8_t>& out, std::uint64_t v) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&v);  // c10d sends host order
  out.insert(out.end(), p, p + sizeof(v));
}

void appendString(std::vector<std::uint8_t>& out, const std::string& s) {
  appendU64(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}

void sendBytes(int fd, const std::vector<std::uint8_t>& bytes) {
  // A few dozen bytes into an empty socket buffer: all of it or an error.
  if (::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(bytes.size())) {
    throwErrno("store_init wire client: send", errno);
  }
}

// The clients of one thread, from connect to the last reply. `wire` is "framed" (ours: HELLO
// and ADD_WAIT in one segment, two replies) or "c10d" (LibTorch 1.13's bytes: ADD; the client
// that brings the count to N SETs init/done; everyone WAITs for it).
void runWireClients(const std::string& wire, std::uint16_t port, int count, int total) {
  const int epfd = ::epoll_create1(EPOLL_CLOEXEC);
  if (epfd < 0) throwErrno("epoll_create1", errno);
  std::vector<WireClient> clients(static_cast<std::size_t>(count));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // A connect not done within its attempt timeout (its SYN dropped by a full accept queue,
  // which the kernel would resend only after a second) starts over, with the timeout doubled:
  // the policy of our StoreClient, applied to every server alike.
  const auto startConnect = [&](std::size_t i) {
    auto& c = clients[i];
    if (c.fd >= 0) ::close(c.fd);
    c.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c.fd < 0) throwErrno("socket", errno);
    const int one = 1;
    ::setsockopt(c.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (::connect(c.fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 && errno != EINPROGRESS) {
      throwErrno("connect", errno);
    }
    c.attemptNs = nowNs();
    epoll_event ev{};
    ev.events = EPOLLOUT;
    ev.data.u64 = i;
    if (::epoll_ctl(epfd, EPOLL_CTL_ADD, c.fd, &ev) != 0) throwErrno("epoll_ctl", errno);
  };
  for (std::size_t i = 0; i < clients.size(); ++i) startConnect(i);
  std::vector<std::uint8_t> request;
  if (wire == "framed") {
    request = rendezvous::encodeRequest({.op = rendezvous::Op::kHello, .keys = {"bench"}});
    const auto add = rendezvous::encodeRequest({.op = rendezvous::Op::kAddWait, .keys = {"init"},
                                                .value = std::to_string(total), .number = 1,
                                                .timeoutMs = 120000});
    request.insert(request.end(), add.begin(), add.end());
  } else {
    request.push_back(3);  // ADD
    appendString(request, "/init");
    appendU64(request, 1);
  }
  std::vector<std::uint8_t> setAndWait;
  setAndWait.push_back(0);  // SET
  appendString(setAndWait, "/init/done");
  appendString(setAndWait, "1");
  std::vector<std::uint8_t> waitOnly;
  waitOnly.push_back(5);  // WAIT
  appendU64(waitOnly, 1);
  appendString(waitOnly, "/init/done");
  setAndWait.insert(setAndWait.end(), waitOnly.begin(), waitOnly.end());

  int pending = count;
  std::vector<epoll_event> events(256);
  long long lastSweep = nowNs();
  const long long deadline = lastSweep + 30'000'000'000LL;
  while (pending > 0) {
    const int n = ::epoll_wait(epfd, events.data(), static_cast<int>(events.size()), 20);
    if (n < 0 && errno != EINTR) throwErrno("epoll_wait", errno);
    if (nowNs() - lastSweep > 20'000'000) {
      lastSweep = nowNs();
      if (lastSweep > deadline) {
        int connecting = 0;
        for (const auto& c : clients) connecting += c.stage == 0 ? 1 : 0;
        throw TimeoutError("store_init wire clients: " + std::to_string(pending) + " waiting, " +
                           std::to_string(connecting) + " of them not connected");
      }
      for (std::size_t i = 0; i < clients.size(); ++i) {
        auto& c = clients[i];
        if (c.stage == 0 && lastSweep - c.attemptNs > c.attemptTimeoutNs) {
          c.attemptTimeoutNs = std::min(c.attemptTimeoutNs * 2, 2'000'000'000LL);
          startConnect(i);
        }
      }
    }
    for (int e = 0; e < std::max(n, 0); ++e) {
      auto& c = clients[events[static_cast<std::size_t>(e)].data.u64];
      if (c.stage == 0) {
        int error = 0;
        socklen_t len = sizeof(error);
        ::getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &error, &len);
        if (error != 0) throwErrno("store_init wire client: connect", error);
        sendBytes(c.fd, request);
        c.stage = 1;
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u64 = events[static_cast<std::size_t>(e)].data.u64;
        ::epoll_ctl(epfd, EPOLL_CTL_MOD, c.fd, &ev);
        continue;
      }
      std::uint8_t buf[512];
      const ssize_t got = ::recv(c.fd, buf, sizeof(buf), 0);
      if (got == 0) throw Error("store_init wire client: the server closed the connection");
      if (got < 0) {
        if (errno == EAGAIN || errno == EINTR) continue;
        throwErrno("store_init wire client: recv", errno);
      }
      c.in.insert(c.in.end(), buf, buf + got);
      bool done = false;
      if (wire == "framed") {
        // Stage 1: the HELLO reply; stage 2: the ADD_WAIT reply.
        while (!done && c.in.size() >= rendezvous::kHeaderSize) {
          const auto h = rendezvous::decodeHeader(std::span(c.in.data(), rendezvous::kHeaderSize), {});
          const std::size_t frame = rendezvous::kHeaderSize + h.bodyLength;
          if (c.in.size() < frame) break;
          c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(frame));
          done = ++c.stage == 3;
        }
      } else if (c.stage == 1 && c.in.size() >= 8) {
        std::uint64_t value = 0;
        std::memcpy(&value, c.in.data(), sizeof(value));
        c.in.erase(c.in.begin(), c.in.begin() + 8);
        sendBytes(c.fd, static_cast<int>(value) == total ? setAndWait : waitOnly);
        c.stage = 2;
      } else if (c.stage == 2 && !c.in.empty()) {
        done = true;  // STOP_WAITING
      }
      if (done) {
        ::epoll_ctl(epfd, EPOLL_CTL_DEL, c.fd, nullptr);
        --pending;
      }
    }
  }
  // Connections stay open until the parent has every time (ranks keep their store).
  for (auto& c : clients) ::close(c.fd);
  ::close(epfd);
}

}  // namespace

// Hidden: one process's share of wire-level store_init clients, two threads each with its own
// epoll (no thread per client: what is measured is the server, not the clients' scheduling).
int storeInitWireHelper(const std::string& wire, std::uint16_t port, int count, int total) {
  raiseDescriptorLimit();
  reserveDescriptorTable(static_cast<std::size_t>(count) + 256);
  constexpr int kThreads = 2;
  std::latch go(1);
  std::vector<long long> starts(kThreads), ends(kThreads);
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    const int share = shareOf(count, kThreads, t);
    threads.emplace_back([&, t, share] {
      go.wait();
      starts[static_cast<std::size_t>(t)] = nowNs();
      try {
        runWireClients(wire, port, share, total);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(t)] = e.what();
      }
      ends[static_cast<std::size_t>(t)] = nowNs();
    });
  }
  std::cout << "ready" << std::endl;
  std::string line;
  std::getline(std::cin, line);
  go.count_down();
  for (auto& t : threads) t.join();
  std::string failed;
  for (const auto& e : errors) {
    if (!e.empty()) failed += (failed.empty() ? "" : "; ") + e;
  }
  if (!failed.empty()) {
    std::cout << "failed: " << failed << std::endl;
    return 1;
  }
  std::cout << *std::min_element(starts.begin(), starts.end()) << " "
            << *std::max_element(ends.begin(), ends.end()) << std::endl;
  return 0;
}

// Hidden: a c10d::TCPStore server in its own process, like fsdprun-rdzv.
// `presized`: its descriptor table grown before it starts, as fsdprun-rdzv's is (c10d's
// grows as connections come).
int c10dServer(bool presized) {
  raiseDescriptorLimit();
  if (presized) reserveDescriptorTable(std::size_t{1} << 17);
  c10d::TCPStoreOptions o;
  o.port = 0;
  o.isServer = true;
  o.waitWorkers = false;
  c10d::TCPStore server("127.0.0.1", o);
  std::cout << "listening on 127.0.0.1:" << server.getPort() << std::endl;
  std::string line;
  std::getline(std::cin, line);  // runs until stdin closes
  return 0;
}

}  // namespace fsdp::bench
