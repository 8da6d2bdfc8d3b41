#include "slurm_cluster.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "fsdp/common/env.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"
#include "run_command.hpp"

extern char** environ;

namespace fsdp::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The guard waits this long for the machine-wide lock (another build tree's system test).
constexpr int kLockWaitSeconds = 240;

milliseconds left(Clock::time_point deadline) {
  return std::max(milliseconds(0),
                  std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
}

// An fd closed by its destructor.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = other.release();
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

std::pair<Fd, Fd> makePipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throwErrno("pipe2", errno);
  return {Fd(fds[0]), Fd(fds[1])};
}

// Reads one line from `fd` within `timeout`; nullopt on timeout or end of file.
std::optional<std::string> readLine(int fd, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::string line;
  for (;;) {
    pollfd pfd{fd, POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(left(deadline).count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return std::nullopt;
    char c = 0;
    const ssize_t n = ::read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return std::nullopt;
    if (c == '\n') return line;
    line += c;
  }
}

// Drops every SLURM_* variable of this process (ctest may itself run inside a Slurm job).
void clearSlurmEnvironment() {
  std::vector<std::string> names;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    if (entry.rfind("SLURM_", 0) == 0) names.push_back(entry.substr(0, entry.find('=')));
  }
  for (const auto& name : names) ::unsetenv(name.c_str());
}

std::vector<std::string> scriptEnv(const SlurmTestCluster::Options& options) {
  return {"FSDP_SLURM_NODES=" + std::to_string(options.nodes),
          "FSDP_SLURM_CPUS=" + std::to_string(options.cpusPerNode),
          "FSDP_SLURM_LOCK_WAIT=" + std::to_string(kLockWaitSeconds)};
}

std::string lastLine(const std::string& text) {
  std::string t = text;
  while (!t.empty() && t.back() == '\n') t.pop_back();
  const auto nl = t.rfind('\n');
  return nl == std::string::npos ? t : t.substr(nl + 1);
}

// Starts cluster_guard.sh detached; returns the write end of its stdin once it holds the lock.
Fd startGuard(const SlurmTestCluster::Options& options) {
  auto [stdinRead, stdinWrite] = makePipe();
  auto [stdoutRead, stdoutWrite] = makePipe();
  SpawnOptions spawn{.argv = {"setsid", "-f", slurmScript("cluster_guard.sh")},
                     .env = currentEnvironment()};
  const auto extra = scriptEnv(options);
  spawn.env.insert(spawn.env.end(), extra.begin(), extra.end());
  spawn.stdinFd = stdinRead.get();
  spawn.stdoutFd = stdoutWrite.get();
  auto setsid = ChildProcess::spawn(spawn);
  stdinRead.reset();
  stdoutWrite.reset();
  // setsid -f returns at once, leaving the guard to init: a ctest timeout that kills our
  // process tree does not reach it.
  const auto status = setsid.waitFor(std::chrono::seconds(10));
  if (!status || *status != 0) throw Error("setsid -f cluster_guard.sh failed");
  const auto line = readLine(stdoutRead.get(), std::chrono::seconds(kLockWaitSeconds + 10));
  if (line != "locked") {
    throw Error("cluster_guard.sh did not get the lock /run/lock/fsdp-slurm-test.lock within " +
                std::to_string(kLockWaitSeconds) + " s (another test cluster is up): got '" +
                line.value_or("<nothing>") + "'");
  }
  return std::move(stdinWrite);
}

void disarm(int fd) {
  static constexpr char kDisarm[] = "disarm\n";
  if (::write(fd, kDisarm, sizeof kDisarm - 1) < 0) {
    // The guard is gone; nothing else can be done about it here.
    std::fprintf(stderr, "cluster guard: %s\n", std::strerror(errno));
  }
}

ino_t inodeOf(const std::string& path, dev_t* dev) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return 0;
  if (dev != nullptr) *dev = st.st_dev;
  return st.st_ino;
}

std::vector<pid_t> allPids() {
  std::vector<pid_t> pids;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (const auto n = parseInt(name); n && *n > 0) pids.push_back(static_cast<pid_t>(*n));
  }
  return pids;
}

std::string readWhole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string slurmScript(const std::string& name) {
  return std::string(FSDP_SOURCE_DIR) + "/tests/system/slurm/" + name;
}

std::string SlurmTestCluster::nodeName(int node) { return "fsdp-n" + std::to_string(node); }

std::string SlurmTestCluster::nodeNamespace(int node) {
  return "fsdp-slurm-n" + std::to_string(node);
}

std::unique_ptr<SlurmTestCluster> SlurmTestCluster::start(const Options& options,
                                                          std::string* skipReason) {
  if (::geteuid() != 0) {
    *skipReason = "must run as root (network namespaces, Slurm daemons)";
    return nullptr;
  }
  clearSlurmEnvironment();
  Fd guard = startGuard(options);
  const auto up = runCommand({slurmScript("cluster_up.sh")}, options.upTimeout, scriptEnv(options));
  if (up.exitCode == 77) {
    *skipReason = lastLine(up.err);
    disarm(guard.get());
    return nullptr;
  }
  if (up.exitCode != 0) {
    // The guard is not disarmed: closing its pipe (Fd's destructor) makes it tear down.
    throw Error("cluster_up.sh failed (" +
                (up.timedOut ? "timed out after " + std::to_string(options.upTimeout.count()) + " s"
                             : "exit code " + std::to_string(up.exitCode)) +
                "):\n" + up.out + up.err);
  }
  const std::string conf = lastLine(up.out);
  if (conf.rfind("SLURM_CONF=", 0) != 0) {
    throw Error("cluster_up.sh printed no SLURM_CONF line:\n" + up.out + up.err);
  }
  ::setenv("SLURM_CONF", conf.substr(11).c_str(), 1);
  return std::unique_ptr<SlurmTestCluster>(
      new SlurmTestCluster(options.nodes, conf.substr(11), guard.release()));
}

SlurmTestCluster::~SlurmTestCluster() {
  const auto down = runCommand({slurmScript("cluster_down.sh")}, std::chrono::seconds(120));
  if (down.exitCode == 0) {
    disarm(guardFd_);
  } else {
    std::fprintf(stderr, "cluster_down.sh failed (%s); the guard tries again:\n%s%s\n",
                 down.timedOut ? "timed out" : "exit code", down.out.c_str(), down.err.c_str());
  }
  ::close(guardFd_);
  ::unsetenv("SLURM_CONF");
}

std::optional<pid_t> SlurmTestCluster::slurmdPid(int node) const {
  const auto dir = std::filesystem::path(slurmConf_).parent_path().parent_path();
  const auto text = readWhole((dir / "run" / ("slurmd-" + nodeName(node) + ".pid")).string());
  const auto n = parseInt(text.substr(0, text.find('\n')));
  if (!n) return std::nullopt;
  return static_cast<pid_t>(*n);
}

std::vector<pid_t> processesInNamespace(const std::string& ns) {
  dev_t dev = 0;
  const ino_t want = inodeOf("/run/netns/" + ns, &dev);
  std::vector<pid_t> out;
  if (want == 0) return out;
  for (const pid_t pid : allPids()) {
    dev_t d = 0;
    if (inodeOf("/proc/" + std::to_string(pid) + "/ns/net", &d) == want && d == dev) {
      out.push_back(pid);
    }
  }
  return out;
}

std::string executableOf(pid_t pid) {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/" + std::to_string(pid) + "/exe", ec);
  return ec ? std::string() : exe.string();
}

std::string describeProcess(pid_t pid) {
  std::string cmdline = readWhole("/proc/" + std::to_string(pid) + "/cmdline");
  std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
  while (!cmdline.empty() && cmdline.back() == ' ') cmdline.pop_back();
  return std::to_string(pid) + " " + executableOf(pid) + " [" + cmdline + "]";
}

std::vector<pid_t> waitForExit(const std::vector<pid_t>& pids, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::vector<pid_t> alive;
  std::vector<Fd> fds;
  for (const pid_t pid : pids) {
    const int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
    if (fd < 0) {
      if (errno != ESRCH) throwErrno("pidfd_open " + std::to_string(pid), errno);
      continue;  // already gone
    }
    alive.push_back(pid);
    fds.emplace_back(fd);
  }
  while (!alive.empty()) {
    std::vector<pollfd> polls;
    for (const auto& fd : fds) polls.push_back({fd.get(), POLLIN, 0});
    const int r = ::poll(polls.data(), polls.size(), static_cast<int>(left(deadline).count()));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throwErrno("poll", errno);
    if (r == 0) break;  // deadline
    for (std::size_t i = polls.size(); i-- > 0;) {
      if (polls[i].revents != 0) {
        alive.erase(alive.begin() + static_cast<std::ptrdiff_t>(i));
        fds.erase(fds.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
  }
  return alive;
}

bool waitForFileText(const std::string& path, const std::string& needle, int count,
                     milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  Fd inotify(::inotify_init1(IN_CLOEXEC | IN_NONBLOCK));
  if (inotify.get() < 0) throwErrno("inotify_init1", errno);
  const std::string dir = std::filesystem::path(path).parent_path().string();
  if (::inotify_add_watch(inotify.get(), dir.c_str(),
                          IN_CREATE | IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO) < 0) {
    throwErrno("inotify_add_watch " + dir, errno);
  }
  for (;;) {
    // Checked after the watch is in place, so no write between check and wait is missed.
    if (countOccurrences(readWhole(path), needle) >= count) return true;
    pollfd pfd{inotify.get(), POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(left(deadline).count()));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throwErrno("poll", errno);
    if (r == 0) return countOccurrences(readWhole(path), needle) >= count;
    alignas(inotify_event) char events[4096];
    while (::read(inotify.get(), events, sizeof events) > 0) {
    }
  }
}

}  // namespace fsdp::testing
