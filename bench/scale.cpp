// rdzv_join and store_init: many clients against one server, the clients spread over several
// processes (a process here may hold at most 20,000 file descriptors). This file starts the
// server and the client processes (the hidden subcommands of scale_clients.cpp), releases
// them together and reports last finish - first start over all processes.
#include <sys/resource.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>

#include "bench.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"

namespace fsdp::bench {
namespace {

using Clock = std::chrono::steady_clock;

// A child process driven through its stdin and read through its stdout, line by line.
class Helper {
 public:
  // `stopBySigterm`: a daemon (fsdprun-rdzv) that serves until SIGTERM rather than until its
  // stdin closes.
  explicit Helper(std::vector<std::string> argv, bool stopBySigterm = false) : stopBySigterm_(stopBySigterm) {
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
    if (!process_) return;
    if (stopBySigterm_) process_->signal(SIGTERM);
    process_->waitFor(std::chrono::seconds(10));
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
  bool stopBySigterm_ = false;
  std::string buffer_;
};

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

// The server under test in its own process; reports its port.
struct ServerProcess {
  std::unique_ptr<Helper> helper;
  std::uint16_t port = 0;
};

ServerProcess startServer(const std::string& kind, bool presizedC10d = false) {
  ServerProcess s;
  const std::string exe = selfExe();
  if (kind == "fsdprun") {
    s.helper = std::make_unique<Helper>(
        std::vector<std::string>{exe.substr(0, exe.rfind('/')) + "/fsdprun-rdzv", "--port", "0"},
        /*stopBySigterm=*/true);
  } else {
    s.helper = std::make_unique<Helper>(
        std::vector<std::string>{exe, "c10d_server", presizedC10d ? "presized" : "as_shipped"});
  }
  const auto line = s.helper->readLine(std::chrono::seconds(10));
  const auto colon = line.rfind(':', line.find(" ("));
  s.port = static_cast<std::uint16_t>(std::stoi(line.substr(colon + 1)));
  return s;
}

std::vector<std::vector<std::string>> split(const std::vector<std::string>& head, int total, int processes) {
  std::vector<std::vector<std::string>> argvs;
  for (int p = 0; p < processes; ++p) {
    const int share = shareOf(total, processes, p);
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
    const double before = procStatusMb(server.helper->pid(), "VmRSS:");
    const double cpuBefore = cpuSeconds(server.helper->pid());
    const auto spread = runHelpers(split({exe, "rdzv_join_helper", std::to_string(server.port)},
                                         static_cast<int>(agents), processes),
                                   std::chrono::seconds(120));
    emit({{"bench", "rdzv_join"},
          {"agents", agents},
          {"client_processes", processes},
          {"first_join_to_last_assignment_s", spread.seconds},
          {"server_rss_mb_idle", before},
          {"server_rss_mb", procStatusMb(server.helper->pid(), "VmRSS:")},
          {"server_cpu_s", cpuSeconds(server.helper->pid()) - cpuBefore}});
  }
}

void storeInit(const Args& args) {
  const std::string which = args.str("server", "both");
  if (which != "both" && which != "ours" && which != "c10d") {
    throw ConfigError("--server '" + which + "': expected ours, c10d or both");
  }
  const std::string clientFlag = args.str("client", "both");
  if (clientFlag != "both" && clientFlag != "libtorch" && clientFlag != "wire") {
    throw ConfigError("--client '" + clientFlag + "': expected libtorch, wire or both");
  }
  // c10d's server as it ships grows its descriptor table as clients connect; "presized" gives
  // it the table fsdprun-rdzv sizes up front, to show what that choice alone is worth.
  const std::string c10dFds = args.str("c10d_fds", "as_shipped");
  if (c10dFds != "as_shipped" && c10dFds != "presized") {
    throw ConfigError("--c10d_fds '" + c10dFds + "': expected as_shipped or presized");
  }
  const bool presizeC10d = c10dFds == "presized";
  const std::string exe = selfExe();
  const int reps = static_cast<int>(args.ints("reps", "3").front());
  // With --nodes K, a third setup: the LibTorch-style clients spread over K processes (nodes),
  // each reaching our server through its own store proxy, as an fsdprun agent's workers do.
  // (0, the default: no proxy setup; the flag itself takes positive counts only.)
  const int nodes = args.str("nodes", "").empty() ? 0 : static_cast<int>(args.ints("nodes", "").front());
  std::vector<std::string> clientKinds;
  if (clientFlag != "wire") clientKinds.push_back("libtorch");
  if (clientFlag != "libtorch") clientKinds.push_back("wire");
  for (const long long clients : args.ints("clients", "1000,10000")) {
    for (const auto& client : clientKinds) {
      // Each setup: a server process and what its clients speak. With real LibTorch
      // clients, ours use our StoreClient and c10d's its TCPStore; with wire clients, every
      // setup gets the same event-driven client, and ours is measured twice: in its own
      // protocol and in c10d's bytes.
      struct Setup {
        std::string name, server, wire;
        int processes = 0;  // 0: one per 2,000 clients
      };
      std::vector<Setup> setups;
      if (client == "libtorch") {
        if (which != "c10d") setups.push_back({"fsdprun", "fsdprun", "fsdprun"});
        if (which != "c10d" && nodes > 0) setups.push_back({"fsdprun_proxy", "fsdprun", "proxy", nodes});
      } else {
        if (which != "c10d") {
          setups.push_back({"fsdprun", "fsdprun", "framed"});
          setups.push_back({"fsdprun_c10d_wire", "fsdprun", "c10d"});
        }
      }
      // c10d's server process needs a descriptor per connection: c10d's 1.13 client opens two,
      // a wire client one. Past what the hard limit allows (20,000 here: 9,000 LibTorch
      // clients), c10d's server is left out rather than failing the whole run.
      const long long c10dDescriptors = clients * (client == "libtorch" ? 2 : 1) + 256;
      rlimit nofile{};
      const bool c10dFits = ::getrlimit(RLIMIT_NOFILE, &nofile) == 0 &&
                            static_cast<rlim_t>(c10dDescriptors) <= nofile.rlim_max;
      if (which != "ours" && c10dFits) {
        setups.push_back({"c10d", "c10d", "c10d"});
      }
      const std::string helper = client == "libtorch" ? "store_init_helper" : "store_init_wire_helper";
      std::map<std::string, std::vector<double>> seconds;
      std::map<std::string, std::vector<double>> serverCpu;
      // Alternate the setups rep by rep, so that all see the same machine.
      for (int rep = 0; rep < reps; ++rep) {
        for (const auto& setup : setups) {
          ServerProcess server = startServer(setup.server, presizeC10d);
          const int processes =
              setup.processes > 0 ? setup.processes : static_cast<int>(std::max(1LL, (clients + 1999) / 2000));
          const double cpuBefore = cpuSeconds(server.helper->pid());
          const auto spread = runHelpers(split({exe, helper, setup.wire, std::to_string(server.port)},
                                               static_cast<int>(clients), processes),
                                         std::chrono::seconds(300));
          seconds[setup.name].push_back(spread.seconds);
          serverCpu[setup.name].push_back(cpuSeconds(server.helper->pid()) - cpuBefore);
        }
      }
      nlohmann::json line = {{"bench", "store_init"}, {"clients", clients}, {"client", client}, {"reps", reps}};
      if (nodes > 0 && client == "libtorch") line["proxy_nodes"] = nodes;
      for (const auto& setup : setups) {
        line[setup.name + "_s_median"] = percentile(seconds[setup.name], 0.5);
        line[setup.name + "_server_cpu_s_median"] = percentile(serverCpu[setup.name], 0.5);
        if (setup.server == "c10d") line["c10d_fds"] = c10dFds;
      }
      if (line.contains("fsdprun_s_median") && line.contains("c10d_s_median")) {
        line["speedup"] = line["c10d_s_median"].get<double>() / line["fsdprun_s_median"].get<double>();
      }
      emit(line);
    }
  }
}

}  // namespace fsdp::bench
