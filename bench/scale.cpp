// rdzv_join and store_init: many clients against one server, the clients spread over several
// processes (a process here may hold at most 20,000 file descriptors). Each client process
// connects first, reports "ready", waits for "go" on stdin, runs the workload and prints
// its first-start and last-finish CLOCK_MONOTONIC times; the parent reports last finish -
// first start over all processes.
#include <sys/resource.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <atomic>
#include <sstream>
#include <fstream>
#include <iostream>
#include <latch>
#include <map>
#include <optional>
#include <thread>

#include "bench.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/rendezvous/rdzv_client.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/rendezvous/store_server.hpp"

namespace fsdp::bench {
namespace {

using Clock = std::chrono::steady_clock;

long long nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

void raiseFdLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    limit.rlim_cur = limit.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &limit);
  }
}


// A child process driven through its stdin and read through its stdout, line by line.
class Helper {
 public:
  explicit Helper(std::vector<std::string> argv) {
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) throwErrno("pipe2", errno);
    SpawnOptions options{.argv = std::move(argv), .env = currentEnvironment()};
    options.stdinFd = in[0];
    options.stdoutFd = out[1];
    process_.emplace(ChildProcess::spawn(options));
    ::close(in[0]);
    ::close(out[1]);
    write_ = in[1];
    read_ = out[0];
  }
  ~Helper() {
    ::close(write_);
    ::close(read_);
    if (process_) process_->waitFor(std::chrono::seconds(10));
  }
  void send(const std::string& line) {
    const std::string l = line + "\n";
    if (::write(write_, l.data(), l.size()) != static_cast<ssize_t>(l.size())) throwErrno("write to helper", errno);
  }
  std::string readLine(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (buffer_.find('\n') == std::string::npos) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      pollfd pfd{read_, POLLIN, 0};
      if (left.count() <= 0 || ::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) {
        throw TimeoutError("bench helper pid " + std::to_string(process_->pid()) + " said nothing for " +
                           std::to_string(timeout.count()) + " ms");
      }
      char buf[4096];
      const ssize_t n = ::read(read_, buf, sizeof(buf));
      if (n <= 0) throw Error("bench helper pid " + std::to_string(process_->pid()) + " exited early");
      buffer_.append(buf, static_cast<std::size_t>(n));
    }
    const auto nl = buffer_.find('\n');
    std::string line = buffer_.substr(0, nl);
    buffer_.erase(0, nl + 1);
    return line;
  }
  int pid() const { return process_->pid(); }

 private:
  std::optional<ChildProcess> process_;
  int write_ = -1;
  int read_ = -1;
  std::string buffer_;
};

double rssMb(int pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0;
}

// CPU seconds (user + system) a process has used so far.
double cpuSeconds(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content;
  std::getline(stat, content);
  std::istringstream fields(content.substr(content.rfind(')') + 2));
  std::string field;
  long long utime = 0, stime = 0;
  for (int i = 3; fields >> field; ++i) {
    if (i == 14) utime = std::stoll(field);
    if (i == 15) {
      stime = std::stoll(field);
      break;
    }
  }
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

struct Spread {
  double seconds = 0;
};

// Starts `processes` helpers with `args`, waits for all "ready", sends "go", collects
// "first last" timestamps.
Spread runHelpers(const std::vector<std::vector<std::string>>& argvs, std::chrono::milliseconds timeout) {
  std::vector<std::unique_ptr<Helper>> helpers;
  for (const auto& argv : argvs) helpers.push_back(std::make_unique<Helper>(argv));
  for (auto& h : helpers) {
    const auto line = h->readLine(timeout);
    if (line != "ready") throw Error("bench helper: " + line);
  }
  for (auto& h : helpers) h->send("go");
  long long first = std::numeric_limits<long long>::max();
  long long last = 0;
  for (auto& h : helpers) {
    const auto line = h->readLine(timeout);
    std::istringstream in(line);
    long long f = 0, l = 0;
    if (!(in >> f >> l)) throw Error("bench helper: " + line);
    first = std::min(first, f);
    last = std::max(last, l);
  }
  return {static_cast<double>(last - first) / 1e9};
}

}  // namespace

// Hidden: one process's share of rdzv_join agents.
int rdzvJoinHelper(std::uint16_t port, int count, int total) {
  raiseFdLimit();
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

// Hidden: one process's share of store_init clients, one thread each. A rank keeps its store
// connection for the whole job, so each client holds its connection (and its thread) until
// every client of this process has finished: closing and thread exit are not store init.
int storeInitHelper(const std::string& server, std::uint16_t port, int count, int total) {
  raiseFdLimit();
  std::latch go(1);
  std::latch finished(count);
  std::atomic<long long> first{std::numeric_limits<long long>::max()};
  std::atomic<long long> last{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < count; ++i) {
    threads.emplace_back([&] {
      go.wait();
      long long start = nowNs();
      long long expected = first.load();
      while (start < expected && !first.compare_exchange_weak(expected, start)) {
      }
      std::unique_ptr<rendezvous::StoreClient> ours;
      std::optional<c10d::TCPStore> theirs;
      try {
        if (server == "fsdprun") {
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
      finished.arrive_and_wait();
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

// Hidden: a c10d::TCPStore server in its own process, like fsdprun-rdzv.
int c10dServer() {
  raiseFdLimit();
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

namespace {

// The server under test in its own process; reports its port.
struct ServerProcess {
  std::unique_ptr<Helper> helper;
  std::uint16_t port = 0;
};

ServerProcess startServer(const std::string& kind) {
  ServerProcess s;
  const std::string exe = selfExe();
  if (kind == "fsdprun") {
    s.helper = std::make_unique<Helper>(std::vector<std::string>{exe.substr(0, exe.rfind('/')) + "/fsdprun-rdzv", "--port", "0"});
  } else {
    s.helper = std::make_unique<Helper>(std::vector<std::string>{exe, "c10d_server"});
  }
  const auto line = s.helper->readLine(std::chrono::seconds(10));
  const auto colon = line.rfind(':', line.find(" ("));
  s.port = static_cast<std::uint16_t>(std::stoi(line.substr(colon + 1)));
  return s;
}

std::vector<std::vector<std::string>> split(const std::vector<std::string>& head, int total, int processes) {
  std::vector<std::vector<std::string>> argvs;
  for (int p = 0; p < processes; ++p) {
    const int share = total / processes + (p < total % processes ? 1 : 0);
    auto argv = head;
    argv.push_back(std::to_string(share));
    argv.push_back(std::to_string(total));
    argvs.push_back(argv);
  }
  return argvs;
}

}  // namespace

void rdzvJoin(const Args& args) {
  const std::string exe = selfExe();
  for (const long long agents : args.ints("agents", "100,1000,10000")) {
    ServerProcess server = startServer("fsdprun");
    const int processes = static_cast<int>(std::max(1LL, (agents + 4999) / 5000));
    const double before = rssMb(server.helper->pid());
    const double cpuBefore = cpuSeconds(server.helper->pid());
    const auto spread = runHelpers(split({exe, "rdzv_join_helper", std::to_string(server.port)},
                                         static_cast<int>(agents), processes),
                                   std::chrono::seconds(120));
    emit({{"bench", "rdzv_join"},
          {"agents", agents},
          {"client_processes", processes},
          {"first_join_to_last_assignment_s", spread.seconds},
          {"server_rss_mb_idle", before},
          {"server_rss_mb", rssMb(server.helper->pid())},
          {"server_cpu_s", cpuSeconds(server.helper->pid()) - cpuBefore}});
  }
}

void storeInit(const Args& args) {
  const std::string which = args.str("server", "both");
  if (which != "both" && which != "ours" && which != "c10d") {
    throw ConfigError("--server '" + which + "': expected ours, c10d or both");
  }
  const std::string exe = selfExe();
  const int reps = static_cast<int>(args.ints("reps", "3").front());
  for (const long long clients : args.ints("clients", "1000,10000")) {
    std::vector<std::string> kinds;
    if (which != "c10d") kinds.push_back("fsdprun");
    // c10d's 1.13 client opens two connections each; past a few thousand clients that is
    // more than this machine's descriptor limit allows one server process.
    if (which != "ours" && clients <= 4000) kinds.push_back("c10d");
    std::map<std::string, std::vector<double>> seconds;
    std::map<std::string, std::vector<double>> serverCpu;
    // Alternate the servers rep by rep, so that both see the same machine.
    for (int rep = 0; rep < reps; ++rep) {
      for (const auto& kind : kinds) {
        ServerProcess server = startServer(kind);
        const int processes = static_cast<int>(std::max(1LL, (clients + 1999) / 2000));
        const double cpuBefore = cpuSeconds(server.helper->pid());
        const auto spread = runHelpers(split({exe, "store_init_helper", kind, std::to_string(server.port)},
                                             static_cast<int>(clients), processes),
                                       std::chrono::seconds(300));
        seconds[kind].push_back(spread.seconds);
        serverCpu[kind].push_back(cpuSeconds(server.helper->pid()) - cpuBefore);
      }
    }
    nlohmann::json line = {{"bench", "store_init"}, {"clients", clients}, {"reps", reps}};
    for (const auto& kind : kinds) {
      const std::string name = kind == "fsdprun" ? "fsdprun" : "c10d";
      line[name + "_s_median"] = percentile(seconds[kind], 0.5);
      line[name + "_server_cpu_s_median"] = percentile(serverCpu[kind], 0.5);
    }
    if (line.contains("fsdprun_s_median") && line.contains("c10d_s_median")) {
      line["speedup"] = line["c10d_s_median"].get<double>() / line["fsdprun_s_median"].get<double>();
    }
    emit(line);
  }
}

}  // namespace fsdp::bench
