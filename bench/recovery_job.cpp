// One job of `fsdp-bench recovery` (see recovery_job.hpp): the processes of a run are found
// through /proc, by the environment the launchers give their workers.
#include "recovery_job.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "bench.hpp"
#include "fsdp/common/error.hpp"

namespace fsdp::bench::recovery_job {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

double unixNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string binDir() {
  const std::string exe = selfExe();
  return exe.substr(0, exe.rfind('/'));
}

RunDir::RunDir() {
  char pattern[] = "/tmp/fsdp-bench-recovery-XXXXXX";
  if (::mkdtemp(pattern) == nullptr) throwErrno("mkdtemp", errno);
  path_ = pattern;
}

RunDir::~RunDir() {
  if (keep_) return;
  std::error_code ec;
  fs::remove_all(path_, ec);
}

RdzvServer::RdzvServer(const std::string& logPath) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throwErrno("pipe2", errno);
  SpawnOptions options{.argv = {binDir() + "/fsdprun-rdzv", "--port", "0"},
                       .env = currentEnvironment()};
  options.stdoutFd = fds[1];
  options.stderrPath = logPath;
  try {
    process_.emplace(ChildProcess::spawn(options));
  } catch (...) {
    ::close(fds[0]);
    ::close(fds[1]);
    throw;
  }
  ::close(fds[1]);
  const std::string line = readLineWithin(fds[0], 10s);  // "fsdprun-rdzv: listening on HOST:PORT (...)"
  ::close(fds[0]);
  const auto colon = line.rfind(':', line.find(" ("));
  if (line.find("listening on") == std::string::npos || colon == std::string::npos) {
    throw Error("recovery: fsdprun-rdzv did not report its port within 10 s; it printed '" + line +
                "'");
  }
  port_ = std::stoi(line.substr(colon + 1));
}

RdzvServer::~RdzvServer() {
  process_->signal(SIGTERM);
  if (!process_->waitFor(10s)) process_->signal(SIGKILL);
}

namespace {

std::string tail(const std::string& path, std::size_t bytes) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string all = text.str();
  return all.substr(all.size() > bytes ? all.size() - bytes : 0);
}

// The last line of a file that parses as a JSON object; null when none does.
nlohmann::json lastJsonObject(const std::string& path) {
  std::ifstream in(path);
  nlohmann::json last;
  for (std::string line; std::getline(in, line);) {
    if (!line.starts_with("{\"")) continue;
    auto parsed = nlohmann::json::parse(line, nullptr, false);
    if (parsed.is_object()) last = std::move(parsed);
  }
  return last;
}

// ---- processes of one run, found through /proc ---------------------------------------------

std::vector<std::string> environOf(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  std::vector<std::string> out;
  for (std::string entry; std::getline(in, entry, '\0');) out.push_back(entry);
  return out;
}

int parentOf(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content;
  std::getline(stat, content);
  const auto close = content.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(content.substr(close + 2));
  std::string state;
  int ppid = 0;
  fields >> state >> ppid;
  return ppid;
}

std::vector<int> allPids() {
  std::vector<int> pids;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename();
    if (!name.empty() && name.find_first_not_of("0123456789") == std::string::npos) {
      pids.push_back(std::stoi(name));
    }
  }
  return pids;
}

bool hasEntries(const std::vector<std::string>& env, const std::vector<std::string>& wanted) {
  return std::all_of(wanted.begin(), wanted.end(), [&](const std::string& w) {
    return std::find(env.begin(), env.end(), w) != env.end();
  });
}

// The process carrying every one of `entries` in its environment that descends from one of
// `roots` (the launchers this bench started), and the root it descends from.
std::optional<std::pair<int, int>> findProcess(const std::vector<std::string>& entries,
                                               const std::set<int>& roots) {
  for (const int pid : allPids()) {
    if (roots.contains(pid) || !hasEntries(environOf(pid), entries)) continue;
    for (int p = parentOf(pid), hops = 0; p > 1 && hops < 16; p = parentOf(p), ++hops) {
      if (roots.contains(p)) return std::make_pair(pid, p);
    }
  }
  return std::nullopt;
}

// The workers of run `runId` under `roots`, by rank (the RANK they were started with).
std::map<int, int> workerPids(const std::string& runId, const std::set<int>& roots) {
  std::map<int, int> out;
  for (const int pid : allPids()) {
    if (roots.contains(pid)) continue;
    const auto env = environOf(pid);
    if (!hasEntries(env, {"TORCHELASTIC_RUN_ID=" + runId})) continue;
    // A spare (--standby) waiting for a later round is not the rank's worker.
    if (std::any_of(env.begin(), env.end(), [](const std::string& e) { return e.rfind("FSDPRUN_STANDBY_FD=", 0) == 0; })) {
      continue;
    }
    bool under = false;
    for (int p = parentOf(pid), hops = 0; p > 1 && hops < 16 && !under; p = parentOf(p), ++hops) under = roots.contains(p);
    if (!under) continue;
    for (const auto& e : env) {
      if (e.rfind("RANK=", 0) == 0) out[std::stoi(e.substr(5))] = pid;
    }
  }
  return out;
}

// The 1-minute load average: how busy the machine was with other work when a figure was taken.
double loadAverage() {
  std::ifstream in("/proc/loadavg");
  double load = -1;
  in >> load;
  return load;
}

// Waits at most `timeout` for `pid`, not a child of ours, to exit (pidfd + poll). True when it
// has (or was gone already).
bool exitsWithin(int pid, std::chrono::milliseconds timeout) {
  const int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) return errno == ESRCH;
  pollfd pfd{fd, POLLIN, 0};
  const bool exited = ::poll(&pfd, 1, static_cast<int>(timeout.count())) > 0;
  ::close(fd);
  return exited;
}

// Rank 0's metrics file, read as it grows: whole JSON lines only. Wakes on inotify events of
// its directory, so that a step is seen when it is written, not at the next poll.
class MetricsTail {
 public:
  explicit MetricsTail(std::string path) : path_(std::move(path)) {
    fd_ = ::inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
    if (fd_ < 0) throwErrno("inotify_init1", errno);
    const auto dir = fs::path(path_).parent_path().string();
    if (::inotify_add_watch(fd_, dir.c_str(), IN_MODIFY | IN_CREATE) < 0) {
      const int err = errno;
      ::close(fd_);
      throwErrno("inotify_add_watch " + dir, err);
    }
  }
  ~MetricsTail() { ::close(fd_); }
  MetricsTail(const MetricsTail&) = delete;
  MetricsTail& operator=(const MetricsTail&) = delete;

  // Waits at most `timeout` for a change in the directory, then reads what is new.
  void wait(std::chrono::milliseconds timeout) {
    pollfd pfd{fd_, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(timeout.count())) > 0) {
      char events[4096];
      while (::read(fd_, events, sizeof(events)) > 0) {
      }
    }
    read();
  }
  void read() {
    std::ifstream in(path_, std::ios::binary);
    if (!in) return;
    in.seekg(static_cast<std::streamoff>(offset_));
    std::string chunk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    partial_ += chunk;
    offset_ += chunk.size();
    for (auto nl = partial_.find('\n'); nl != std::string::npos; nl = partial_.find('\n')) {
      const std::string line = partial_.substr(0, nl);
      partial_.erase(0, nl + 1);
      if (line.empty() || line.front() != '{') continue;
      try {
        lines_.push_back(nlohmann::json::parse(line));
      } catch (const nlohmann::json::exception&) {
        // not one of the trainer's lines; nothing to measure in it
      }
    }
  }
  const std::vector<nlohmann::json>& lines() const { return lines_; }
  long long lastTrainStep() const {
    const auto* last = lastTrain();
    return last == nullptr ? 0 : last->value("step", 0LL);
  }
  // The median step time so far: a step that also wrote a checkpoint does not count double.
  double medianStepMs() const {
    std::vector<double> ms;
    for (const auto& l : lines_) {
      if (l.value("type", "") == "train") ms.push_back(l.value("step_time_ms", 0.0));
    }
    return ms.empty() ? 0 : percentile(ms, 0.5);
  }

 private:
  std::string path_;
  int fd_ = -1;
  std::size_t offset_ = 0;
  std::string partial_;
  std::vector<nlohmann::json> lines_;

  const nlohmann::json* lastTrain() const {
    for (auto it = lines_.rbegin(); it != lines_.rend(); ++it) {
      if (it->value("type", "") == "train") return &*it;
    }
    return nullptr;
  }
};

}  // namespace

std::vector<std::string> jobEnvironment(const std::string& runId) {
  std::vector<std::string> env;
  for (const auto& e : currentEnvironment()) {
    if (!e.starts_with("OMP_NUM_THREADS=")) env.push_back(e);
  }
  env.push_back("OMP_NUM_THREADS=1");
  if (std::getenv("GLIBC_TUNABLES") == nullptr) env.push_back("GLIBC_TUNABLES=glibc.malloc.hugetlb=1");
  env.push_back("FSDP_BENCH_RECOVERY_RUN=" + runId);
  return env;
}

Observed runJob(const Launch& launch, const RunDir& dir, Kill kill, KillAt at,
                std::chrono::seconds limit) {
  Observed seen;
  seen.loadBefore = loadAverage();
  MetricsTail metrics(launch.metricsFile);
  std::vector<ChildProcess> launchers;
  std::set<int> roots;
  for (std::size_t i = 0; i < launch.agents.size(); ++i) {
    SpawnOptions options{.argv = launch.agents[i], .env = launch.env};
    options.stdoutPath = dir.path() + "/launcher" + std::to_string(i) + ".out";
    options.stderrPath = dir.path() + "/launcher" + std::to_string(i) + ".err";
    launchers.push_back(ChildProcess::spawn(options));
    roots.insert(launchers.back().pid());
  }
  const auto deadline = Clock::now() + limit;
  bool killed = kill == Kill::kNone;
  const auto running = [&] {
    return std::any_of(launchers.begin(), launchers.end(),
                       [](ChildProcess& c) { return !c.reaped() && !c.tryWait(); });
  };
  while (running() && Clock::now() < deadline) {
    metrics.wait(200ms);
    if (seen.killUnixTime && !seen.ranksStillRunning) {
      // Once the state is back: who runs each rank now (the survivors' pids, kept or not).
      const double killTime = *seen.killUnixTime;
      if (std::any_of(metrics.lines().begin(), metrics.lines().end(), [&](const nlohmann::json& l) {
            return l.value("type", "") == "resume" && l.value("unix_time", 0.0) > killTime;
          })) {
        // Who of those running at the kill still runs: the survivors that kept their processes.
        std::set<int> alive;
        for (const auto& [rank, pid] : seen.pidsAtKill) {
          std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
          std::string text;
          std::getline(stat, text);
          const auto close = text.rfind(')');
          if (close != std::string::npos && close + 2 < text.size() && text[close + 2] != 'Z') alive.insert(rank);
        }
        seen.ranksStillRunning = alive;
      }
    }
    if (killed || metrics.lastTrainStep() < at.afterStep) continue;
    std::this_thread::sleep_for(
        std::chrono::duration<double, std::milli>(at.fractionOfStep * metrics.medianStepMs()));
    const std::string rank = "RANK=" + std::to_string(at.rank);
    const auto target = findProcess(
        {"TORCHELASTIC_RUN_ID=" + launch.runId, rank, "TORCHELASTIC_RESTART_COUNT=0"}, roots);
    if (!target) {
      seen.error = "no process with " + rank + " of run " + launch.runId +
                   " under the launchers at step " + std::to_string(metrics.lastTrainStep());
      break;
    }
    const auto [worker, agent] = *target;
    seen.pidsAtKill = workerPids(launch.runId, roots);
    seen.killUnixTime = unixNow();
    if (kill == Kill::kWorker) {
      ::kill(worker, SIGKILL);
    } else {
      ::kill(agent, SIGKILL);
      for (std::size_t i = 0; i < launchers.size(); ++i) {
        if (launchers[i].pid() == agent) seen.killedLauncher = i;
      }
      // A lost node loses its worker too: the agent's death signal (PR_SET_PDEATHSIG) ends it.
      if (!exitsWithin(worker, 3s)) {
        seen.workerDiedWithAgent = false;
        ::kill(worker, SIGKILL);
      }
    }
    killed = true;
  }
  metrics.read();
  seen.lines = metrics.lines();
  if (running()) {
    if (seen.error.empty()) {
      const std::string survivor = seen.killedLauncher == 0u ? "1" : "0";
      seen.error = "the job did not end within " + std::to_string(limit.count()) +
                   " s (last step " + std::to_string(metrics.lastTrainStep()) + "); launcher " +
                   survivor + "'s log ends: " +
                   tail(dir.path() + "/launcher" + survivor + ".err", 400);
    }
  } else if (seen.error.empty()) {
    seen.finished = true;
    for (std::size_t i = 0; i < launchers.size(); ++i) {
      if (seen.killedLauncher == i) continue;
      const int status = *launchers[i].status();
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        seen.finished = false;
        seen.error = "launcher " + std::to_string(i) + " ended with " + describeWaitStatus(status) +
                     ": " + tail(dir.path() + "/launcher" + std::to_string(i) + ".err", 400);
      }
    }
  }
  for (std::size_t i = 0; i < launchers.size(); ++i) {
    if (seen.killedLauncher == i) continue;
    const auto summary = lastJsonObject(dir.path() + "/launcher" + std::to_string(i) + ".out");
    if (summary.is_object()) seen.summary = summary;
  }
  // What the launchers left (a torchrun worker outlives its SIGKILLed launcher): every process
  // with this run's tag in its environment, which only processes this bench started carry.
  for (auto& l : launchers) {
    if (!l.reaped()) l.signal(SIGKILL);
  }
  for (int round = 0; round < 2; ++round) {
    for (const int pid : allPids()) {
      if (hasEntries(environOf(pid), {"FSDP_BENCH_RECOVERY_RUN=" + launch.runId})) {
        ::kill(pid, SIGKILL);
      }
    }
  }
  return seen;
}

// ---- figures (the metrics lines read back) ------------------------------------------------

double median(std::vector<double> v) { return v.empty() ? -1 : percentile(v, 0.5); }

double stepMs(const std::vector<nlohmann::json>& lines, std::size_t from) {
  std::vector<double> ms;
  int sinceStart = 0;
  for (std::size_t i = from; i < lines.size(); ++i) {
    const auto& l = lines[i];
    const auto type = l.value("type", "");
    if (type == "resume") sinceStart = kWarmupSteps - kStepsAfterResume;
    if (type == "train" && ++sinceStart > kWarmupSteps) ms.push_back(l.value("step_time_ms", 0.0));
  }
  return median(ms);
}

void killFigures(const Observed& seen, nlohmann::json& line) {
  const double killTime = *seen.killUnixTime;
  long long before = 0;  // the last step completed before the kill
  std::optional<std::size_t> resume;
  for (std::size_t i = 0; i < seen.lines.size(); ++i) {
    const auto& l = seen.lines[i];
    const double t = l.value("unix_time", 0.0);
    if (l.value("type", "") == "train" && t <= killTime) {
      before = std::max(before, l.value("step", 0LL));
    }
    if (!resume && l.value("type", "") == "resume" && t > killTime) resume = i;
  }
  line["step_ms"] = stepMs(seen.lines);
  // The ranks that were not killed: how many kept their processes through the recovery.
  if (seen.ranksStillRunning) {
    int survivors = 0, kept = 0;
    for (const auto& [rank, pid] : seen.pidsAtKill) {
      if (rank == line.value("kill_rank_of_worker", -1)) continue;
      ++survivors;
      kept += seen.ranksStillRunning->contains(rank) ? 1 : 0;
    }
    line["survivors"] = survivors;
    line["survivors_kept_pid"] = kept;
  }
  if (!resume) {
    line["kill_step"] = before;
    line["error"] = "no resume line after the kill in the metrics file";
    return;
  }
  const auto& r = seen.lines[*resume];
  const long long resumed = r.value("step", 0LL);
  // Rank 0 stamps a train line after the step's metrics are reduced, so on a loaded machine the
  // line of a step every rank had finished (and snapshotted) can bear a time after the kill. A
  // resume from step R proves every rank had finished R before the kill: that bounds it too.
  before = std::max(before, resumed);
  line["kill_step"] = before;
  line["resumed_step"] = resumed;
  line["steps_redone"] = before - resumed;
  line["source"] = r.value("source", "");
  line["restore_ms"] = r.value("restore_ms", 0.0);
  // Of kill -> restored, the part inside the new worker process (its start-up and the restore).
  if (r.contains("process_age_s")) line["restored_at_process_age_s"] = r["process_age_s"];
  line["kill_to_restored_s"] = r.value("unix_time", 0.0) - killTime;
  if (r.contains("path")) line["recovery_path"] = r["path"];  // rank 0's: in_process or process
  // In process: how long rank 0 went on after the agent's notice (to its next collective).
  if (r.contains("notice_to_reform_ms")) line["notice_to_reform_ms"] = r["notice_to_reform_ms"];
  // The durations of the first steps after the resume (ms): a replacement's first steps fault
  // its memory in and make its next snapshots' buffers, which the overhead does not count.
  nlohmann::json after = nlohmann::json::array();
  double previous = r.value("unix_time", 0.0);
  const auto shown = static_cast<std::size_t>(kStepsAfterResume);
  for (std::size_t i = *resume + 1; i < seen.lines.size() && after.size() < shown; ++i) {
    const auto& l = seen.lines[i];
    if (l.value("type", "") != "train") continue;
    after.push_back(std::round(1000.0 * (l.value("unix_time", 0.0) - previous)));
    previous = l.value("unix_time", 0.0);
  }
  line["steps_after_ms"] = std::move(after);
  // The median step after the resume (its first kStepsAfterResume left out), where there is one.
  if (const double ms = stepMs(seen.lines, *resume); ms > 0) line["step_ms_after"] = ms;
  // The median step the figures below subtract: of the world that resumed where it is not the one
  // killed (a world without the lost node steps slower), else of the whole run.
  // What the steps after the first of those took beyond as many median steps: what the overhead
  // (which counts the first) leaves out.
  const double medianMs = line.value(line.value("world_changes", false) && line.contains("step_ms_after")
                                         ? "step_ms_after" : "step_ms", 0.0);
  if (line["steps_after_ms"].size() == shown && medianMs > 0) {
    double sum = 0;
    for (std::size_t i = 1; i < shown; ++i) sum += line["steps_after_ms"][i].get<double>();
    line["steps_after_extra_s"] = (sum - static_cast<double>(shown - 1) * medianMs) / 1000.0;
  }
  for (std::size_t i = *resume + 1; i < seen.lines.size(); ++i) {
    const auto& l = seen.lines[i];
    if (l.value("type", "") != "train") continue;
    if (!line.contains("kill_to_first_step_s")) {
      line["kill_to_first_step_s"] = l.value("unix_time", 0.0) - killTime;
      // What the failure cost beyond the step it interrupted: kill -> first new step, less one
      // median step (above; of the whole run where the world stays: the steps right after a
      // resume are slower while new processes make their snapshot buffers).
      line["recovery_overhead_s"] = line["kill_to_first_step_s"].get<double>() - medianMs / 1000.0;
    }
    // Back where the job was: the first step beyond the last one completed before the kill.
    if (l.value("step", 0LL) > before) {
      line["kill_to_caught_up_s"] = l.value("unix_time", 0.0) - killTime;
      break;
    }
  }
}

void nodeFigures(bool agentHosts, int worldAfter, Observed& seen, nlohmann::json& line) {
  if (seen.killedLauncher) line["killed_launcher"] = *seen.killedLauncher;
  long long last = 0;
  for (const auto& l : seen.lines) {
    if (l.value("type", "") == "train") last = std::max(last, l.value("step", 0LL));
  }
  line["metrics_last_step"] = last;
  if (seen.summary.contains("world_size")) {
    line["world_size_after"] = seen.summary["world_size"];
    if (seen.summary.contains("resumed_source")) {
      line["resumed_source"] = seen.summary["resumed_source"];
    }
  }
  if (!seen.error.empty() || !seen.killUnixTime) return;
  if (!seen.summary.contains("world_size")) {
    seen.error = "no launcher printed rank 0's summary line";
  } else if (seen.summary["world_size"] != worldAfter) {
    seen.error = "world size " + seen.summary["world_size"].dump() +
                 " after the resume, expected " + std::to_string(worldAfter);
  } else if (agentHosts && seen.killedLauncher != 0u) {
    seen.error = "the agent of RANK=0 was launcher " +
                 (seen.killedLauncher ? std::to_string(*seen.killedLauncher) : "none") +
                 ", not the rendezvous host (launcher 0)";
  }
}

}  // namespace fsdp::bench::recovery_job
