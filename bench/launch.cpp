// The launcher benchmarks, fsdprun side by side with torchrun (python3-torch 1.13, at its
// fastest setting --monitor_interval 0.1) in the same invocation, alternating runs:
//   launch       --standalone --nproc_per_node N: wall of a /bin/true job, and launcher start
//                -> every worker started (stamped by fsdp-stamp)
//   restart      rank 0 exits 1 once; its exit -> every restarted worker started, for one
//                node of 2 workers and for 2 agents of 1 worker
//   multi_agent  K agents on loopback: last agent started -> every worker started, and the
//                agents' peak RSS
// Worker start times come from fsdp-stamp, which writes CLOCK_MONOTONIC, the clock of
// std::chrono::steady_clock here.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "bench.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"

namespace fsdp::bench {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

long long nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

std::string binDir() {
  const std::string exe = selfExe();
  return exe.substr(0, exe.rfind('/'));
}

struct Stamp {
  std::string event;
  long long ns = 0;
  int rank = -1;
  int restart = -1;
};

std::vector<Stamp> readStamps(const std::string& dir) {
  std::vector<Stamp> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.path().extension() != ".stamp") continue;
    std::ifstream in(entry.path());
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      Stamp s;
      std::string kv;
      fields >> s.event >> s.ns;
      while (fields >> kv) {
        const auto eq = kv.find('=');
        const std::string key = kv.substr(0, eq);
        const std::string value = kv.substr(eq + 1);
        if (value.empty()) continue;
        if (key == "rank") s.rank = std::stoi(value);
        if (key == "restart") s.restart = std::stoi(value);
      }
      out.push_back(s);
    }
  }
  return out;
}

// A private scratch directory for one run.
class RunDir {
 public:
  RunDir() {
    char pattern[] = "/tmp/fsdp-bench-launch-XXXXXX";
    if (::mkdtemp(pattern) == nullptr) throwErrno("mkdtemp", errno);
    path_ = pattern;
  }
  ~RunDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct JobRun {
  bool ok = false;
  long long startNs = 0;      // just before the first launcher was spawned
  long long lastSpawnNs = 0;  // just after the last one was
  double wallMs = 0;          // first spawn -> last launcher exited
  std::vector<Stamp> stamps;
  std::vector<double> peakRssMb;  // per launcher, when sampled
  std::string error;
};

// Starts every command at once (output to files), waits for all; samples each launcher's
// peak RSS while it runs when asked (it is gone from /proc once it exits).
JobRun runJob(const std::vector<std::vector<std::string>>& commands, const RunDir& dir,
              bool sampleRss, std::chrono::seconds limit = 60s) {
  JobRun run;
  std::vector<ChildProcess> children;
  run.startNs = nowNs();
  for (std::size_t i = 0; i < commands.size(); ++i) {
    SpawnOptions options{.argv = commands[i], .env = currentEnvironment()};
    options.stdoutPath = dir.path() + "/launcher" + std::to_string(i) + ".out";
    options.stderrPath = dir.path() + "/launcher" + std::to_string(i) + ".err";
    children.push_back(ChildProcess::spawn(options));
  }
  run.lastSpawnNs = nowNs();
  std::vector<double> peaks(children.size(), 0);  // MB
  const auto deadline = Clock::now() + limit;
  std::size_t done = 0;
  while (done < children.size() && Clock::now() < deadline) {
    done = 0;
    for (std::size_t i = 0; i < children.size(); ++i) {
      if (children[i].reaped()) {
        ++done;
        continue;
      }
      if (sampleRss) peaks[i] = std::max(peaks[i], procStatusMb(children[i].pid(), "VmHWM:"));
      if (children[i].tryWait()) ++done;
    }
    if (done < children.size()) {
      if (sampleRss) {
        std::this_thread::sleep_for(20ms);  // sampling: the figure is the max seen
      } else {
        for (auto& c : children) {
          if (!c.reaped()) c.waitFor(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
        }
      }
    }
  }
  run.wallMs = static_cast<double>(nowNs() - run.startNs) / 1e6;
  run.ok = true;
  for (std::size_t i = 0; i < children.size(); ++i) {
    const auto status = children[i].status();
    if (!status || !WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
      run.ok = false;
      std::ifstream err(dir.path() + "/launcher" + std::to_string(i) + ".err");
      std::stringstream text;
      text << err.rdbuf();
      const std::string all = text.str();
      run.error = (status ? describeWaitStatus(*status) : std::string("timed out")) + ": " +
                  all.substr(all.size() > 300 ? all.size() - 300 : 0);
    }
    run.peakRssMb.push_back(peaks[i]);
  }
  run.stamps = readStamps(dir.path());
  return run;
}

struct Launcher {
  std::string name;
  bool available = true;
  std::string why;
  // argv for one agent: common flags + `flags` + the worker command.
  std::function<std::vector<std::string>(const std::vector<std::string>& flags,
                                         const std::vector<std::string>& worker)>
      command;
};

std::vector<Launcher> launchers(const Args& args) {
  const std::string fsdprun = binDir() + "/fsdprun";
  const std::string torchrun =
      args.str("torchrun", std::string(FSDP_SOURCE_DIR) + "/../shared/peer-torchrun/torchrun_fixed");
  Launcher ours{"fsdprun", true, "",
                [fsdprun](const std::vector<std::string>& flags, const std::vector<std::string>& worker) {
                  std::vector<std::string> argv = {fsdprun};
                  argv.insert(argv.end(), flags.begin(), flags.end());
                  argv.insert(argv.end(), worker.begin(), worker.end());
                  return argv;
                }};
  Launcher peer{"torchrun", true, "",
                [torchrun](const std::vector<std::string>& flags, const std::vector<std::string>& worker) {
                  std::vector<std::string> argv = {"/usr/bin/python3", torchrun, "--monitor_interval", "0.1"};
                  argv.insert(argv.end(), flags.begin(), flags.end());
                  argv.push_back("--no_python");
                  argv.insert(argv.end(), worker.begin(), worker.end());
                  return argv;
                }};
  if (::access(torchrun.c_str(), R_OK) != 0 || ::access("/usr/bin/python3", X_OK) != 0) {
    peer.available = false;
    peer.why = "needs python3-torch and " + torchrun + " (--torchrun PATH)";
  }
  return {ours, peer};
}

double median(std::vector<double> v) { return v.empty() ? -1 : percentile(v, 0.5); }

// Emits one line per launcher and a comparison line.
void report(nlohmann::json base, const std::vector<Launcher>& ls,
            const std::map<std::string, std::map<std::string, std::vector<double>>>& figures,
            const std::map<std::string, int>& failures, const std::string& compareKey) {
  std::map<std::string, double> compare;
  for (const auto& l : ls) {
    nlohmann::json line = base;
    line["launcher"] = l.name;
    if (!l.available) {
      line["unavailable"] = l.why;
      emit(line);
      continue;
    }
    const auto it = figures.find(l.name);
    if (it != figures.end()) {
      for (const auto& [key, samples] : it->second) line[key + "_median"] = median(samples);
      if (it->second.contains(compareKey)) compare[l.name] = median(it->second.at(compareKey));
    }
    line["failed_runs"] = failures.contains(l.name) ? failures.at(l.name) : 0;
    emit(line);
  }
  if (compare.contains("fsdprun") && compare.contains("torchrun") && compare["fsdprun"] > 0) {
    nlohmann::json line = base;
    line["compare"] = compareKey;
    line["speedup"] = compare["torchrun"] / compare["fsdprun"];
    emit(line);
  }
}

}  // namespace

void launch(const Args& args) {
  const auto ns = args.ints("n", "1,2,4,8");
  const int reps = static_cast<int>(args.ints("reps", "5").front());
  const auto ls = launchers(args);
  const std::string stamp = binDir() + "/fsdp-stamp";
  for (const long long n : ns) {
    std::map<std::string, std::map<std::string, std::vector<double>>> figures;
    std::map<std::string, int> failures;
    for (int r = 0; r < reps; ++r) {
      for (const auto& l : ls) {
        if (!l.available) continue;
        const std::vector<std::string> flags = {"--standalone", "--nnodes", "1", "--nproc_per_node",
                                                std::to_string(n)};
        RunDir plain;
        const auto wall = runJob({l.command(flags, {"/bin/true"})}, plain, false);
        RunDir stamped;
        const auto start = runJob({l.command(flags, {stamp, stamped.path(), "true"})}, stamped, false);
        if (!wall.ok || !start.ok || static_cast<long long>(start.stamps.size()) != n) {
          ++failures[l.name];
          continue;
        }
        long long last = 0;
        for (const auto& s : start.stamps) last = std::max(last, s.ns);
        figures[l.name]["wall_ms"].push_back(wall.wallMs);
        figures[l.name]["start_to_all_workers_ms"].push_back(static_cast<double>(last - start.startNs) / 1e6);
      }
    }
    report({{"bench", "launch"}, {"nproc_per_node", n}, {"reps", reps}, {"worker", "/bin/true"}}, ls,
           figures, failures, "wall_ms");
  }
}

void restart(const Args& args) {
  const int reps = static_cast<int>(args.ints("reps", "5").front());
  const std::string setups = args.str("setups", "standalone2,agents2");
  const auto ls = launchers(args);
  const std::string stamp = binDir() + "/fsdp-stamp";
  std::stringstream list(setups);
  std::string setup;
  while (std::getline(list, setup, ',')) {
    std::map<std::string, std::map<std::string, std::vector<double>>> figures;
    std::map<std::string, int> failures;
    for (int r = 0; r < reps; ++r) {
      for (const auto& l : ls) {
        if (!l.available) continue;
        RunDir dir;
        const std::vector<std::string> worker = {stamp, dir.path(), "fail_once"};
        std::vector<std::vector<std::string>> commands;
        if (setup == "standalone2") {
          commands.push_back(l.command({"--standalone", "--nnodes", "1", "--nproc_per_node", "2",
                                        "--max_restarts", "3"},
                                       worker));
        } else if (setup == "agents2") {
          const std::string port = std::to_string(freePort());
          const std::string id = "restart-" + std::to_string(::getpid()) + "-" + std::to_string(r);
          for (int a = 0; a < 2; ++a) {
            commands.push_back(l.command({"--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                                          "--rdzv_endpoint", "127.0.0.1:" + port, "--rdzv_id", id,
                                          "--max_restarts", "3"},
                                         worker));
          }
        } else {
          throw ConfigError("--setups '" + setups + "': expected standalone2 and/or agents2");
        }
        const auto run = runJob(commands, dir, false);
        std::optional<long long> exit;
        std::vector<long long> restarted;
        for (const auto& s : run.stamps) {
          if (s.event == "exit") exit = s.ns;
        }
        for (const auto& s : run.stamps) {
          if (exit && s.event == "start" && s.ns > *exit) restarted.push_back(s.ns);
        }
        if (!run.ok || !exit || restarted.size() != 2) {
          ++failures[l.name];
          continue;
        }
        figures[l.name]["exit_to_all_restarted_ms"].push_back(
            static_cast<double>(*std::max_element(restarted.begin(), restarted.end()) - *exit) / 1e6);
        figures[l.name]["wall_ms"].push_back(run.wallMs);
      }
    }
    report({{"bench", "restart"}, {"setup", setup}, {"reps", reps}}, ls, figures, failures,
           "exit_to_all_restarted_ms");
  }
}

void multiAgent(const Args& args) {
  const auto ks = args.ints("agents", "2,4,8,16");
  const int reps = static_cast<int>(args.ints("reps", "3").front());
  const auto ls = launchers(args);
  const std::string stamp = binDir() + "/fsdp-stamp";
  for (const long long k : ks) {
    std::map<std::string, std::map<std::string, std::vector<double>>> figures;
    std::map<std::string, int> failures;
    for (int r = 0; r < reps; ++r) {
      for (const auto& l : ls) {
        if (!l.available) continue;
        RunDir dir;
        const std::string port = std::to_string(freePort());
        const std::string id = "agents-" + std::to_string(::getpid()) + "-" + std::to_string(k) + "-" + std::to_string(r);
        std::vector<std::vector<std::string>> commands;
        for (long long a = 0; a < k; ++a) {
          // Workers stay up half a second so that every agent can be sampled while it runs.
          commands.push_back(l.command({"--nnodes", std::to_string(k), "--nproc_per_node", "1",
                                        "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:" + port,
                                        "--rdzv_id", id},
                                       {stamp, dir.path(), "sleep", "0.5"}));
        }
        const auto run = runJob(commands, dir, true);
        if (!run.ok || static_cast<long long>(run.stamps.size()) != k) {
          ++failures[l.name];
          continue;
        }
        long long last = 0;
        for (const auto& s : run.stamps) last = std::max(last, s.ns);
        figures[l.name]["last_agent_to_all_workers_ms"].push_back(static_cast<double>(last - run.lastSpawnNs) / 1e6);
        figures[l.name]["first_agent_to_all_workers_ms"].push_back(static_cast<double>(last - run.startNs) / 1e6);
        figures[l.name]["agent_peak_rss_mb"].push_back(*std::max_element(run.peakRssMb.begin(), run.peakRssMb.end()));
      }
    }
    report({{"bench", "multi_agent"}, {"agents", k}, {"reps", reps}}, ls, figures, failures,
           "first_agent_to_all_workers_ms");
    // The memory ratio, from the same runs.
    if (figures.contains("fsdprun") && figures.contains("torchrun")) {
      emit({{"bench", "multi_agent"},
            {"agents", k},
            {"compare", "agent_peak_rss_mb"},
            {"ratio_fsdprun_to_torchrun", median(figures["fsdprun"]["agent_peak_rss_mb"]) /
                                              median(figures["torchrun"]["agent_peak_rss_mb"])}});
    }
  }
}

}  // namespace fsdp::bench
