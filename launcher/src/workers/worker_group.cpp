#include "worker_group.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"

namespace fsdp::launcher::detail {
namespace {

constexpr std::size_t kTailLines = 20;
constexpr std::size_t kTailLineBytes = 2000;

}  // namespace

// Writes all of `data` to fd (console or file); a console that went away is not an error.
void writeAll(int fd, const char* data, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data += w;
    n -= static_cast<std::size_t>(w);
  }
}

namespace {

int openLog(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_APPEND, 0644);
  if (fd < 0) throwErrno("opening the worker log " + path, errno);
  return fd;
}

}  // namespace

std::optional<std::string> readErrorFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  const auto j = nlohmann::json::parse(text.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("message")) {
    const std::string raw = text.str();
    if (raw.empty()) return std::nullopt;
    return raw.substr(0, 4000);
  }
  const auto& m = j["message"];
  if (m.is_string()) return m.get<std::string>();
  if (m.is_object()) {
    std::string out = m.value("message", std::string());
    if (m.contains("extraInfo") && m["extraInfo"].is_object()) {
      const auto stack = m["extraInfo"].value("py_callstack", std::string());
      if (!stack.empty()) out += "\n" + stack;
    }
    return out;
  }
  return m.dump();
}

WorkerGroup::WorkerGroup(std::vector<WorkerSpec> specs, const OutputOptions& output,
                         std::string attemptDir, Guardian& guardian, bool standby, bool control)
    : output_(output), attemptDir_(std::move(attemptDir)), guardian_(guardian), control_(control) {
  workers_.reserve(specs.size());
  if (::pipe2(lifelineNews_, O_CLOEXEC | O_NONBLOCK) != 0) throwErrno("pipe2 for the workers' lifelines", errno);
  for (auto& spec : specs) {
    Worker& w = workers_.emplace_back();
    w.spec = std::move(spec);
    spawn(workers_.size() - 1, standby);
  }
}

void WorkerGroup::spawn(std::size_t index, bool standby) {
  Worker& w = workers_[index];
  {
    std::error_code ec;
    std::filesystem::create_directories(dirOf(w.spec.localRank), ec);
    if (ec) {
      throw Error("creating the worker directory " + dirOf(w.spec.localRank) + ": " + ec.message());
    }
  }
  {
    SpawnOptions spawn{.argv = w.spec.argv, .env = w.spec.env};
    if (!w.spec.cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int c : w.spec.cpus) CPU_SET(c, &set);
      spawn.cpuAffinity = set;
    }
    for (int node : w.spec.memNodes) {
      if (node >= 0 && node < 64) spawn.memoryNodes |= 1UL << node;
    }
    setUpStream(w, w.out, kStdout, spawn);
    setUpStream(w, w.err, kStderr, spawn);
    w.started = Deadline::Clock::now();
    // The child's ends of the pipes are in spawn.stdoutFd/stderrFd; close ours after exec.
    int standbyEnd = -1;
    int lifelineEnd = -1;
    int flightEnd = -1;
    int pystacksEnd = -1;
    struct CloseChildEnds {
      SpawnOptions& s;
      int& standby;
      int& lifeline;
      int& flight;
      int& pystacks;
      ~CloseChildEnds() {
        if (s.stdoutFd) ::close(*s.stdoutFd);
        if (s.stderrFd) ::close(*s.stderrFd);
        if (standby >= 0) ::close(standby);
        if (lifeline >= 0) ::close(lifeline);
        if (flight >= 0) ::close(flight);
        if (pystacks >= 0) ::close(pystacks);
      }
    } closer{spawn, standbyEnd, lifelineEnd, flightEnd, pystacksEnd};
    try {
      // The worker's flight recorder: the agent keeps the mapping, so the ring stays readable
      // however the worker ends.
      w.flight = std::make_shared<flight::RingMemory>(flight::RingMemory::create());
      flightEnd = ::fcntl(w.flight->fd(), F_DUPFD, 3);  // crosses exec
      if (flightEnd >= 0) spawn.env.push_back("FSDPRUN_FLIGHT_FD=" + std::to_string(flightEnd));
    } catch (const Error& e) {
      log::warn("no flight recorder for local rank {} ({}): a hang of it is not seen", w.spec.localRank, e.what());
    }
    try {
      // Where a Python worker that imported fsdprun writes its stacks when asked (py_stacks.hpp).
      w.pystacks = PyStackFile::create();
      pystacksEnd = ::fcntl(w.pystacks->fd(), F_DUPFD, 3);  // crosses exec
      if (pystacksEnd >= 0) {
        spawn.env.push_back("FSDPRUN_PYSTACK_FD=" + std::to_string(pystacksEnd));
        spawn.env.push_back("FSDPRUN_PYSTACK_SIGNAL=" + std::to_string(pyStackSignal()));
      }
    } catch (const Error& e) {
      log::debug("no Python stacks for local rank {} ({})", w.spec.localRank, e.what());
    }
    if (index < 256) {
      try {
        w.lifeline = std::make_unique<LifelineWatch>(lifelineNews_[1], static_cast<unsigned char>(index));
        // A duplicate without close-on-exec crosses exec (this thread is the only one that spawns).
        lifelineEnd = ::fcntl(w.lifeline->fd(), F_DUPFD, 3);
        if (lifelineEnd >= 0) spawn.env.push_back("FSDPRUN_LIFELINE_FD=" + std::to_string(lifelineEnd));
      } catch (const Error& e) {
        log::debug("no lifeline for local rank {} ({}): its exit is learnt when it is reaped", w.spec.localRank,
                   e.what());
      }
    }
    int controlEnd = -1;
    if (control_) {
      // The worker's control channel (worker/src/reform/control.hpp): one JSON object a packet.
      std::array<int, 2> pair{};
      if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair.data()) == 0) {
        w.control = pair[0];
        w.ready = false;
        ::fcntl(w.control, F_SETFL, ::fcntl(w.control, F_GETFL) | O_NONBLOCK);
        controlEnd = ::fcntl(pair[1], F_DUPFD, 3);  // crosses exec
        ::close(pair[1]);
        if (controlEnd >= 0) spawn.env.push_back("FSDPRUN_CONTROL_FD=" + std::to_string(controlEnd));
      } else {
        log::debug("no control channel for local rank {} ({}): it restarts as a process", w.spec.localRank,
                   std::strerror(errno));
      }
    }
    struct CloseControl {
      int& fd;
      ~CloseControl() {
        if (fd >= 0) ::close(fd);
      }
    } controlCloser{controlEnd};
    if (standby) {
      std::array<int, 2> fds{};
      if (::pipe2(fds.data(), O_CLOEXEC) != 0) throwErrno("pipe2 for a standby worker", errno);
      standbyEnd = fds[0];
      w.activation = fds[1];
      // The read end alone crosses exec (this thread is the only one that spawns).
      ::fcntl(standbyEnd, F_SETFD, 0);
      spawn.env.push_back("FSDPRUN_STANDBY_FD=" + std::to_string(standbyEnd));
    }
    w.process = ChildProcess::spawn(spawn);
    guardian_.watch(w.process->pid());
  }
}

WorkerGroup::~WorkerGroup() {
  for (auto& w : workers_) {
    if (w.activation >= 0) ::close(w.activation);
    if (w.control >= 0) ::close(w.control);
    for (Stream* s : {&w.out, &w.err}) {
      if (s->fd >= 0) ::close(s->fd);
      if (s->fileFd >= 0) ::close(s->fileFd);
    }
    if (w.process && !w.reported) {
      const pid_t pid = w.process->pid();
      w.process.reset();  // kills the process group and reaps the worker
      guardian_.forget(pid);
    }
    w.lifeline.reset();
  }
  std::vector<pid_t> dead;
  for (const auto& p : dying_) dead.push_back(p.pid());
  dying_.clear();  // each waits for its process's end
  for (const pid_t pid : dead) guardian_.forget(pid);
  for (const int fd : lifelineNews_) ::close(fd);
}

std::string WorkerGroup::dirOf(int localRank) const {
  return attemptDir_ + "/" + std::to_string(localRank);
}

void WorkerGroup::setUpStream(Worker& w, Stream& s, int bit, SpawnOptions& spawn) {
  const int lr = w.spec.localRank;
  const bool redirected = (output_.redirects.forRank(lr) & bit) != 0;
  const bool teed = (output_.tee.forRank(lr) & bit) != 0;
  const bool filtered = output_.localRanksFilter && !output_.localRanksFilter->contains(lr);
  const bool toFile = redirected || teed;
  const bool toConsole = !redirected && !filtered;
  s.prefix = teed && toConsole;
  s.keepTail = bit == kStderr;  // the failure report quotes it
  const std::string file = dirOf(lr) + (bit == kStdout ? "/stdout.log" : "/stderr.log");
  if (!s.keepTail && !s.prefix) {
    // Nothing to do in between: let the worker write straight to its destination.
    if (toFile && !toConsole) {
      spawn.stdoutPath = file;
    } else if (!toFile && !toConsole) {
      spawn.stdoutPath = "/dev/null";
    }
    if (!toFile || !toConsole) return;  // inherited console, or one file
  }
  std::array<int, 2> fds{};
  if (::pipe2(fds.data(), O_CLOEXEC) != 0) throwErrno("pipe2 for worker output", errno);
  ::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  s.fd = fds[0];
  (bit == kStdout ? spawn.stdoutFd : spawn.stderrFd) = fds[1];
  s.consoleFd = toConsole ? (bit == kStdout ? STDOUT_FILENO : STDERR_FILENO) : -1;
  if (toFile) s.fileFd = openLog(file);
}

void WorkerGroup::addPollFds(std::vector<pollfd>& fds) const {
  fds.push_back({lifelineNews_[0], POLLIN, 0});
  for (const auto& w : workers_) {
    for (const Stream* s : {&w.out, &w.err}) {
      if (s->fd >= 0) fds.push_back({s->fd, POLLIN, 0});
    }
    if (w.control >= 0) fds.push_back({w.control, POLLIN, 0});
  }
}

void WorkerGroup::pump(const std::vector<pollfd>& fds) {
  for (const auto& p : fds) {
    if ((p.revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
    for (auto& w : workers_) {
      if (w.out.fd == p.fd) readStream(w, w.out);
      if (w.err.fd == p.fd) readStream(w, w.err);
      if (w.control == p.fd) readControl(w);
    }
  }
}

void WorkerGroup::readStream(Worker& w, Stream& s) {
  std::array<char, 65536> buffer{};
  for (;;) {
    const ssize_t n = ::read(s.fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {  // EOF (every writer closed) or a broken pipe
      ::close(s.fd);
      s.fd = -1;
      return;
    }
    const auto size = static_cast<std::size_t>(n);
    if (s.fileFd >= 0) writeAll(s.fileFd, buffer.data(), size);
    if (s.keepTail) keepTail(w, buffer.data(), size);
    if (s.consoleFd < 0) continue;
    if (!s.prefix) {
      writeAll(s.consoleFd, buffer.data(), size);
      continue;
    }
    // One write per chunk, so that ranks sharing the console interleave by whole chunks.
    const std::string tag = "[rank" + std::to_string(w.spec.rank) + "]:";
    std::string out;
    out.reserve(size + tag.size() * 4);
    for (std::size_t i = 0; i < size; ++i) {
      if (s.atLineStart) out += tag;
      out += buffer[i];
      s.atLineStart = buffer[i] == '\n';
    }
    writeAll(s.consoleFd, out.data(), out.size());
  }
}

void WorkerGroup::keepTail(Worker& w, const char* data, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if (data[i] == '\n') {
      w.tail.push_back(std::move(w.partial));
      w.partial.clear();
      if (w.tail.size() > kTailLines) w.tail.pop_front();
    } else if (w.partial.size() < kTailLineBytes) {
      w.partial += data[i];
    }
  }
}

void WorkerGroup::drainStreams(Worker& w) {
  // Whatever the worker wrote before it died belongs before the news of its death. A pipe may
  // stay open in a grandchild; read what is there without waiting for its EOF.
  for (Stream* s : {&w.out, &w.err}) {
    if (s->fd >= 0) readStream(w, *s);
  }
}

void WorkerGroup::takeLifelineNews(std::vector<WorkerExit>& exits) {
  std::array<unsigned char, 256> news{};
  for (;;) {
    const ssize_t n = ::read(lifelineNews_[0], news.data(), news.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    for (ssize_t i = 0; i < n; ++i) {
      if (news[static_cast<std::size_t>(i)] >= workers_.size()) continue;
      Worker& w = workers_[news[static_cast<std::size_t>(i)]];
      if (w.reported || w.exitTold || !w.process || w.process->reaped()) continue;
      // Released by the kernel for its dead holder; an exec releases it too, and the process
      // then goes on: /proc says which.
      const pid_t pid = w.process->pid();
      const auto status = exitingStatus(pid);
      if (!status) {
        log::debug("rank {} (pid {}) dropped its lifeline without exiting", w.spec.rank, pid);
        continue;
      }
      w.exitTold = true;
      // Nothing the worker started outlives it (the group exists until its leader is reaped).
      ::kill(-pid, SIGKILL);
      drainStreams(w);
      exits.push_back({w.spec.localRank, w.spec.rank, pid, *status,
                       std::chrono::duration<double>(Deadline::Clock::now() - w.started).count()});
    }
  }
}

std::vector<WorkerExit> WorkerGroup::reap() {
  std::vector<WorkerExit> exits;
  takeLifelineNews(exits);
  std::erase_if(dying_, [this](ChildProcess& p) {
    if (!p.tryWait()) return false;
    guardian_.forget(p.pid());
    return true;
  });
  for (auto& w : workers_) {
    if (w.reported || !w.process) continue;
    const pid_t pid = w.process->pid();
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(pid), &info, WSTOPPED | WCONTINUED | WNOHANG) == 0 &&
        info.si_pid == pid) {
      if (info.si_code == CLD_STOPPED) {
        log::warn("rank {} (pid {}) was stopped by {}: its peers block in their next collective "
                  "until it gets SIGCONT, or fail when their collective timeout expires",
                  w.spec.rank, pid, signalName(info.si_status));
      } else if (info.si_code == CLD_CONTINUED) {
        log::info("rank {} (pid {}) continues", w.spec.rank, pid);
      }
    }
    const auto status = w.process->tryWait();
    if (!status) continue;
    w.reported = true;
    // Nothing the worker started outlives it: its process group goes now, while its id cannot
    // have been reused (the group had members, or the leader was reaped just now).
    ::kill(-pid, SIGKILL);
    guardian_.forget(pid);
    drainStreams(w);
    if (w.exitTold) continue;
    w.exitTold = true;
    exits.push_back({w.spec.localRank, w.spec.rank, w.process->pid(), *status,
                     std::chrono::duration<double>(Deadline::Clock::now() - w.started).count()});
  }
  return exits;
}

void WorkerGroup::signalAll(int sig, const std::set<int>& spare) {
  const bool stop = sig == SIGTERM || sig == SIGINT || sig == SIGHUP || sig == SIGQUIT;
  for (auto& w : workers_) {
    if (!w.process || w.process->reaped() || spare.contains(w.spec.localRank)) continue;
    w.process->signal(sig);
    if (stop) w.process->signal(SIGCONT);
  }
}

std::size_t WorkerGroup::running(const std::set<int>& besides) const {
  std::size_t n = 0;
  for (const auto& w : workers_) {
    const bool gone = w.reported || w.freesItselfUnreaped();
    n += w.process && !gone && !besides.contains(w.spec.localRank) ? 1 : 0;
  }
  return n;
}

std::vector<WatchedWorker> WorkerGroup::watched() const {
  std::vector<WatchedWorker> out;
  for (const auto& w : workers_) {
    if (w.process) out.push_back({w.spec.localRank, w.spec.rank, w.process->pid(), w.flight, w.pystacks});
  }
  return out;
}

std::vector<pid_t> WorkerGroup::pids() const {
  std::vector<pid_t> out;
  for (const auto& w : workers_) {
    if (w.process) out.push_back(w.process->pid());
  }
  return out;
}

std::optional<std::string> WorkerGroup::errorMessage(int localRank) const {
  return readErrorFile(dirOf(localRank) + "/error.json");
}

std::string WorkerGroup::stderrTail(int localRank) const {
  for (const auto& w : workers_) {
    if (w.spec.localRank != localRank) continue;
    std::string out;
    for (const auto& line : w.tail) out += line + "\n";
    if (!w.partial.empty()) out += w.partial + "\n";
    return out;
  }
  return {};
}

std::map<std::string, std::string> envMap(const std::vector<std::string>& env) {
  std::map<std::string, std::string> m;
  for (const auto& e : env) {
    const auto eq = e.find('=');
    m[e.substr(0, eq)] = eq == std::string::npos ? "" : e.substr(eq + 1);
  }
  return m;
}

std::string identityChange(const std::map<std::string, std::string>& was, const std::map<std::string, std::string>& now,
                           const std::vector<const char*>& keys, int localRank) {
  for (const char* key : keys) {
    const auto a = was.find(key);
    const auto b = now.find(key);
    if ((a == was.end()) != (b == now.end()) || (a != was.end() && a->second != b->second)) {
      return std::string(key) + " of local rank " + std::to_string(localRank) + " is now " +
             (b == now.end() ? "unset" : b->second) + ", not " + (a == was.end() ? "unset" : a->second);
    }
  }
  return "";
}

nlohmann::json envChanges(const std::map<std::string, std::string>& was, const std::map<std::string, std::string>& now) {
  nlohmann::json env = nlohmann::json::object();
  for (const auto& [key, value] : now) {
    const auto a = was.find(key);
    if (a == was.end() || a->second != value) env[key] = value;
  }
  return env;
}

// What makes a worker who it is: a standby started as another is of no use.
const std::vector<const char*> kStandbyIdentity = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE"};

bool WorkerGroup::activate(const std::vector<WorkerSpec>& specs, std::string& why) {
  const auto& kIdentity = kStandbyIdentity;
  if (specs.size() != workers_.size()) {
    why = std::to_string(specs.size()) + " workers now, " + std::to_string(workers_.size()) + " standbys";
    return false;
  }
  std::vector<std::string> messages;
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    auto& w = workers_[i];
    if (w.activation < 0 || !w.process || w.process->reaped() || w.process->tryWait()) {
      why = "the standby of local rank " + std::to_string(w.spec.localRank) + " has exited";
      if (w.process && w.process->reaped()) w.reported = true;
      return false;
    }
    if (specs[i].argv != w.spec.argv || specs[i].localRank != w.spec.localRank) {
      why = "local rank " + std::to_string(specs[i].localRank) + " runs another command";
      return false;
    }
    const auto was = envMap(w.spec.env);
    const auto now = envMap(specs[i].env);
    why = identityChange(was, now, kIdentity, specs[i].localRank);
    if (!why.empty()) return false;
    messages.push_back(nlohmann::json{{"env", envChanges(was, now)}}.dump() + "\n");
  }
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    auto& w = workers_[i];
    // A message this small goes into an empty pipe whole; a standby that died in between
    // reads nothing, and its exit is reaped as a worker's.
    writeAll(w.activation, messages[i].data(), messages[i].size());
    ::close(w.activation);
    w.activation = -1;
    w.spec = specs[i];
    w.started = Deadline::Clock::now();
  }
  return true;
}

std::vector<std::string> WorkerGroup::exitedSpares() {
  std::vector<std::string> lines;
  for (const auto& exit : reap()) {
    std::string line = "rank " + std::to_string(exit.rank) + " (pid " + std::to_string(exit.pid) +
                       ") exited while it waited (" + describeWaitStatus(exit.status) + ")";
    const std::string file = dirOf(exit.localRank) + "/error.json";
    std::string said = readErrorFile(file).value_or("");
    std::error_code ec;
    std::filesystem::remove(file, ec);
    // Else its last words on stderr: the line it did not end, else the last one not empty.
    const Worker& w = *std::find_if(workers_.begin(), workers_.end(),
                                    [&](const Worker& v) { return v.spec.localRank == exit.localRank; });
    if (said.empty()) said = w.partial;
    for (auto last = w.tail.rbegin(); said.empty() && last != w.tail.rend(); ++last) said = *last;
    if (!said.empty()) line += ": " + said;
    lines.push_back(std::move(line));
  }
  return lines;
}

}  // namespace fsdp::launcher::detail
