// slurm_env_probe [--check] [--exchange]: what fsdprun will read from a real Slurm job.
// Started by the system test in batch scripts and srun steps of the test cluster; prints one
// line per field of readSlurmJob(), prefixed by the host name:
//   fsdp-n2 nnodes: 2 (SLURM_STEP_NUM_NODES)
// --check     also runs checkOneTaskPerNode and checkInsideStep ("<host> check: ok" or the
//             ConfigError's message, exit 2).
// --exchange  does what the launcher will do with it: node 0 listens on the resolved head node
//             at the derived rendezvous port, every other node connects by name and gets an
//             answer ("<host> exchange: ..."). 30 s deadline; exit 1 on failure.
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <thread>

#include "fsdp/common/env.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/slurm/slurm_env.hpp"

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kExchangeTimeout = std::chrono::seconds(30);

std::string hostName() {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  return name;
}

int remainingMs(Clock::time_point deadline) {
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return ms > 0 ? static_cast<int>(ms) : 0;
}

// An fd closed by its destructor.
struct Socket {
  int fd = -1;
  explicit Socket(int f) : fd(f) {}
  ~Socket() {
    if (fd >= 0) ::close(fd);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
};

addrinfo* numericAddress(const std::string& address, int port, int flags) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | flags;
  addrinfo* out = nullptr;
  if (const int rc = ::getaddrinfo(address.c_str(), std::to_string(port).c_str(), &hints, &out)) {
    throw fsdp::Error("getaddrinfo " + address + ": " + ::gai_strerror(rc));
  }
  return out;
}

bool waitFor(int fd, short events, Clock::time_point deadline) {
  pollfd pfd{fd, events, 0};
  return ::poll(&pfd, 1, remainingMs(deadline)) == 1;
}

std::string readLine(int fd, Clock::time_point deadline) {
  std::string line;
  char c = 0;
  while (waitFor(fd, POLLIN, deadline) && ::read(fd, &c, 1) == 1) {
    if (c == '\n') return line;
    line += c;
  }
  throw fsdp::TimeoutError("no complete line from the peer");
}

void writeLine(int fd, const std::string& line) {
  const std::string data = line + "\n";
  if (::write(fd, data.data(), data.size()) != static_cast<ssize_t>(data.size())) {
    fsdp::throwErrno("write", errno);
  }
}

void serve(const std::string& address, int port, int peers, const std::string& me) {
  const auto deadline = Clock::now() + kExchangeTimeout;
  addrinfo* ai = numericAddress(address, port, AI_PASSIVE);
  Socket server(::socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const int one = 1;
  ::setsockopt(server.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  const int bound = ::bind(server.fd, ai->ai_addr, ai->ai_addrlen);
  ::freeaddrinfo(ai);
  if (bound != 0 || ::listen(server.fd, 16) != 0) {
    fsdp::throwErrno("listen on " + address + ":" + std::to_string(port), errno);
  }
  std::cout << me << " exchange: listening on " << address << ":" << port << std::endl;
  for (int i = 0; i < peers; ++i) {
    if (!waitFor(server.fd, POLLIN, deadline)) {
      throw fsdp::TimeoutError("only " + std::to_string(i) + " of " + std::to_string(peers) +
                               " peers connected within 30 s");
    }
    Socket peer(::accept4(server.fd, nullptr, nullptr, SOCK_CLOEXEC));
    if (peer.fd < 0) fsdp::throwErrno("accept", errno);
    const std::string hello = readLine(peer.fd, deadline);
    writeLine(peer.fd, "welcome " + hello.substr(hello.find(' ') + 1) + " from " + me);
    std::cout << me << " exchange: got '" << hello << "'" << std::endl;
  }
}

void join(const std::string& host, const std::string& address, int port, const std::string& me) {
  const auto deadline = Clock::now() + kExchangeTimeout;
  std::mt19937 jitter(static_cast<unsigned>(::getpid()));
  auto backoff = std::chrono::milliseconds(20);
  for (;;) {
    addrinfo* ai = numericAddress(address, port, 0);
    Socket s(::socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    // connect() gives up after SO_SNDTIMEO on Linux: a dropped SYN cannot outlive the deadline.
    const timeval limit{remainingMs(deadline) / 1000, (remainingMs(deadline) % 1000) * 1000};
    ::setsockopt(s.fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
    const int rc = ::connect(s.fd, ai->ai_addr, ai->ai_addrlen);
    ::freeaddrinfo(ai);
    if (rc == 0) {
      writeLine(s.fd, "hello " + me);
      std::cout << me << " exchange: " << readLine(s.fd, deadline) << std::endl;
      return;
    }
    if (errno != ECONNREFUSED || remainingMs(deadline) == 0) {
      fsdp::throwErrno("connect to " + host + " (" + address + "):" + std::to_string(port), errno);
    }
    // The head node may not listen yet: reconnect with exponential backoff and jitter.
    std::this_thread::sleep_for(backoff + std::chrono::milliseconds(jitter() % 20));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool check = false;
  bool exchange = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--check") {
      check = true;
    } else if (arg == "--exchange") {
      exchange = true;
    } else {
      std::cerr << "usage: slurm_env_probe [--check] [--exchange]\n";
      return 2;
    }
  }
  const std::string me = hostName();
  try {
    const auto job = fsdp::slurm::readSlurmJob(fsdp::processEnv());
    if (!job) {
      std::cout << me << " not under Slurm" << std::endl;
      return 1;
    }
    for (const auto& line : fsdp::slurm::describe(*job)) std::cout << me << " " << line << "\n";
    std::cout.flush();
    if (check) {
      fsdp::slurm::checkOneTaskPerNode(*job);
      fsdp::slurm::checkInsideStep(*job);
      std::cout << me << " check: ok" << std::endl;
    }
    if (exchange) {
      const std::string address = fsdp::slurm::resolveHeadNode(*job);
      std::cout << me << " head_address: " << address << std::endl;
      const int nodeId = job->nodeId ? job->nodeId->value : 0;
      if (nodeId == 0) {
        serve(address, job->rdzvPort.value, job->numNodes.value - 1, me);
      } else {
        join(job->headNode.value, address, job->rdzvPort.value, me);
      }
    }
  } catch (const fsdp::ConfigError& e) {
    std::cout << me << " check: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cout << me << " error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
