// store_abuse: fsdprun-rdzv under clients that misbehave. (1) Clients that send requests and
// never read the replies: the server's RSS with the per-connection and server-wide caps off
// and on (the one client with 100 GETs of a 16 MB value, and 100 such clients with
// 20 GETs of 1 MiB each). (2) A storm of 1,000 abusive clients (a third never read, a third
// send half a frame and stall, a third connect and close in a loop) while 100 well-behaved
// clients run a store_init barrier: their latency against a quiet run, and the server's RSS.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <thread>

#include "bench.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/rendezvous/protocol.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "pytorch_wire.hpp"

namespace fsdp::bench {
namespace {

using Clock = std::chrono::steady_clock;
using testing::pytorch_wire::Bytes;
using namespace std::chrono_literals;

// fsdprun-rdzv in a process of its own, with `flags`; killed by the destructor.
class Daemon {
 public:
  explicit Daemon(const std::vector<std::string>& flags) {
    int fds[2];
    if (::pipe(fds) != 0) throwErrno("pipe", errno);
    const std::string exe = selfExe();
    SpawnOptions options{.argv = {exe.substr(0, exe.rfind('/')) + "/fsdprun-rdzv", "--port", "0"},
                         .env = currentEnvironment()};
    options.argv.insert(options.argv.end(), flags.begin(), flags.end());
    static const std::string kQuiet = "FSDP_LOG_LEVEL=error";
    options.env.push_back(kQuiet);
    options.stdoutFd = fds[1];
    process_.emplace(ChildProcess::spawn(options));
    ::close(fds[1]);
    std::string line;
    char c = 0;
    while (::read(fds[0], &c, 1) == 1 && c != '\n') line += c;
    ::close(fds[0]);
    const auto colon = line.rfind(':', line.find(" ("));
    if (colon == std::string::npos) throw Error("fsdprun-rdzv did not start: '" + line + "'");
    port_ = static_cast<std::uint16_t>(std::stoi(line.substr(colon + 1)));
  }
  ~Daemon() {
    process_->signal(SIGKILL);
    process_->waitFor(10s);
  }
  std::uint16_t port() const { return port_; }
  int pid() const { return process_->pid(); }

 private:
  std::optional<ChildProcess> process_;
  std::uint16_t port_ = 0;
};

const auto pytorchSet = testing::pytorch_wire::set113;
const auto pytorchGets = testing::pytorch_wire::gets113;

int connectTo(std::uint16_t port, bool smallReceiveBuffer) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (smallReceiveBuffer) {
    const int size = 4096;
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof(size));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    ::close(fd);
    throwErrno("store_abuse: connect", err);
  }
  return fd;
}

void sendAll(int fd, const Bytes& bytes) {
  std::size_t sent = 0;
  while (sent < bytes.size()) {
    const auto n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;  // closed by the server: that is one of the outcomes measured
    sent += static_cast<std::size_t>(n);
  }
}

// Waits until the server's RSS has not grown for a second (it has read what it will read),
// at most 60 s; returns its peak RSS in MB.
double settledPeakMb(int pid) {
  double last = procStatusMb(pid, "VmRSS:");
  auto stableSince = Clock::now();
  const auto deadline = Clock::now() + 60s;
  while (Clock::now() - stableSince < 1s && Clock::now() < deadline) {
    std::this_thread::sleep_for(100ms);
    const double now = procStatusMb(pid, "VmRSS:");
    if (now > last + 1) stableSince = Clock::now();
    last = std::max(last, now);
  }
  return procStatusMb(pid, "VmHWM:");
}

// `clients` clients each connect, add 1 to a counter and wait for it to reach `clients`: the
// seconds from the first start to the last finish.
double storeInitBarrier(std::uint16_t port, int clients, const std::string& key) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  const auto start = Clock::now();
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&] {
      try {
        auto client = rendezvous::StoreClient::connect("127.0.0.1", port, {.timeout = 60s});
        client->addAndWait(key, 1, clients, 60s);
      } catch (const std::exception&) {
        ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  if (failures > 0) throw Error("store_abuse: " + std::to_string(failures.load()) + " of " +
                                std::to_string(clients) + " well-behaved clients failed");
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::vector<std::string> capFlags(bool capped) {
  if (capped) return {};
  return {"--max_queued_bytes", "0", "--max_queued_bytes_total", "0"};
}

// Non-reading clients: `clients` connections each pipelining `gets` GETs of a `valueBytes`
// value and reading nothing.
void slowReaders(int clients, int gets, std::size_t valueBytes, const std::string& scenario) {
  for (const bool capped : {false, true}) {
    Daemon server(capFlags(capped));
    const double idle = procStatusMb(server.pid(), "VmRSS:");
    const int writer = connectTo(server.port(), false);
    sendAll(writer, pytorchSet("big", std::string(valueBytes, 'v')));
    std::vector<int> fds;
    for (int c = 0; c < clients; ++c) {
      fds.push_back(connectTo(server.port(), true));
      sendAll(fds.back(), pytorchGets("big", gets));
    }
    const double peak = settledPeakMb(server.pid());
    const double barrier = storeInitBarrier(server.port(), 100, "init");
    emit({{"bench", "store_abuse"},
          {"scenario", scenario},
          {"caps", capped ? "on (4 MiB per connection, 256 MiB in all)" : "off"},
          {"non_reading_clients", clients},
          {"gets_each", gets},
          {"value_bytes", valueBytes},
          {"server_rss_mb_idle", idle},
          {"server_rss_mb_peak", peak},
          {"store_init_100_s", barrier}});
    for (const int fd : fds) ::close(fd);
    ::close(writer);
  }
}

// 1,000 abusive clients, a third of each kind, held open (the connect-close loop runs on)
// until `stop`.
class Storm {
 public:
  Storm(std::uint16_t port, int clients, const std::string& kinds) {
    const int writer = connectTo(port, false);
    sendAll(writer, pytorchSet("storm", std::string(64u << 10, 's')));
    fds_.push_back(writer);
    const auto half = rendezvous::encodeRequest(
        {.op = rendezvous::Op::kHello, .keys = {"storm"}, .value = "nonce"});
    for (int c = 0; c < clients; ++c) {
      if (kinds.find(std::to_string(c % 3)) == std::string::npos) continue;
      switch (c % 3) {
        case 0: {  // never reads
          const int fd = connectTo(port, true);
          sendAll(fd, pytorchGets("storm", 200));
          fds_.push_back(fd);
          break;
        }
        case 1: {  // half a frame, then nothing
          const int fd = connectTo(port, false);
          sendAll(fd, Bytes(half.begin(), half.begin() + static_cast<std::ptrdiff_t>(half.size() / 2)));
          fds_.push_back(fd);
          break;
        }
        default:
          ++churners_;
          break;
      }
    }
    // The third kind: connect and close, as fast as one thread can, for as long as it lasts.
    churn_ = std::thread([this, port] {
      while (!stop_ && churners_ > 0) {
        const int fd = connectTo(port, false);
        ::close(fd);
        ++churned_;
      }
    });
  }
  ~Storm() {
    stop_ = true;
    churn_.join();
    for (const int fd : fds_) ::close(fd);
  }
  long long churned() const { return churned_; }
  int churners() const { return churners_; }

 private:
  std::vector<int> fds_;
  std::thread churn_;
  std::atomic<bool> stop_{false};
  std::atomic<long long> churned_{0};
  int churners_ = 0;
};

}  // namespace

void storeAbuse(const Args& args) {
  const int reps = static_cast<int>(args.ints("reps", "3").front());
  const int stormClients = static_cast<int>(args.ints("storm", "1000").front());
  // (1) The reproduction, then 100 non-reading clients.
  slowReaders(1, 100, 16u << 20, "one client, 100 GETs of a 16 MB value");
  slowReaders(static_cast<int>(args.ints("clients", "100").front()), 20, 1u << 20,
              "100 clients, 20 GETs of a 1 MiB value each");
  // (2) The storm: quiet and stormy store_init barriers of 100 clients, alternating.
  std::vector<double> quiet;
  std::vector<double> burst;   // the barrier starts with the storm
  std::vector<double> stormy;  // the barrier starts once the abusers' first burst was served
  double rssQuiet = 0;
  double rssStorm = 0;
  long long churned = 0;
  for (int rep = 0; rep < reps; ++rep) {
    {
      Daemon server({});
      quiet.push_back(storeInitBarrier(server.port(), 100, "init"));
      rssQuiet = std::max(rssQuiet, procStatusMb(server.pid(), "VmHWM:"));
    }
    {
      Daemon server({});
      Storm storm(server.port(), stormClients, args.str("kinds", "012"));
      burst.push_back(storeInitBarrier(server.port(), 100, "init"));
      rssStorm = std::max(rssStorm, settledPeakMb(server.pid()));
      stormy.push_back(storeInitBarrier(server.port(), 100, "init2"));
      churned += storm.churned();
    }
  }
  const double q = percentile(quiet, 0.5);
  const double s = percentile(stormy, 0.5);
  const double b = percentile(burst, 0.5);
  emit({{"bench", "store_abuse"},
        {"scenario", "storm"},
        {"abusive_clients", stormClients},
        {"well_behaved_clients", 100},
        {"reps", reps},
        {"store_init_100_quiet_s_median", q},
        {"store_init_100_storm_s_median", s},
        {"storm_over_quiet", s / q},
        {"store_init_100_storm_burst_s_median", b},
        {"storm_burst_over_quiet", b / q},
        {"server_rss_mb_peak_quiet", rssQuiet},
        {"server_rss_mb_peak_storm", rssStorm},
        {"connect_close_cycles", churned}});
}

}  // namespace fsdp::bench
