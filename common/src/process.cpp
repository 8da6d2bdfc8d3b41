#include "fsdp/common/process.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

#include "fsdp/common/error.hpp"

extern char** environ;

namespace fsdp {
namespace {

// Closes an fd on scope exit.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

std::vector<char*> cStrings(const std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (const auto& s : strings) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// Runs in the child, which shares the parent's memory (CLONE_VM | CLONE_VFORK) until it
// execs: system calls only, no allocation, nothing written but its own stack.
[[noreturn]] void childAfterFork(const SpawnOptions& options, pid_t parent, const char* program,
                                 char* const* argv, char* const* envp, int errorPipe) {
  auto fail = [errorPipe](int err) {
    [[maybe_unused]] auto n = ::write(errorPipe, &err, sizeof(err));
    ::_exit(127);
  };
  if (options.newProcessGroup && ::setpgid(0, 0) != 0) fail(errno);
  if (options.deathSignal != 0) {
    if (::prctl(PR_SET_PDEATHSIG, options.deathSignal) != 0) fail(errno);
    // The parent may have died before prctl took effect.
    if (::getppid() != parent) ::_exit(127);
  }
  // Every signal the parent handles or ignores starts at its default in the program (a
  // handler would run the parent's code on the shared memory before exec; an inherited
  // SIG_IGN of SIGPIPE would change how the program fails). Then unblock everything.
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig == SIGKILL || sig == SIGSTOP) continue;
    struct sigaction current {};
    if (::sigaction(sig, nullptr, &current) == 0 && current.sa_handler != SIG_DFL) {
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      ::sigaction(sig, &dfl, nullptr);
    }
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  auto redirect = [&](const std::optional<std::string>& path, int target) {
    if (!path) return;
    const int fd = ::open(path->c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || ::dup2(fd, target) < 0) fail(errno);
  };
  redirect(options.stdoutPath, STDOUT_FILENO);
  if (options.stdoutFd && ::dup2(*options.stdoutFd, STDOUT_FILENO) < 0) fail(errno);
  if (options.stdinFd && ::dup2(*options.stdinFd, STDIN_FILENO) < 0) fail(errno);
  redirect(options.stderrPath, STDERR_FILENO);
  if (options.stderrFd && ::dup2(*options.stderrFd, STDERR_FILENO) < 0) fail(errno);
  if (options.cpuAffinity && ::sched_setaffinity(0, sizeof(cpu_set_t), &*options.cpuAffinity) != 0) fail(errno);
  constexpr int kMpolBind = 2;  // <numaif.h>'s MPOL_BIND, without libnuma
  if (options.memoryNodes != 0 &&
      ::syscall(SYS_set_mempolicy, kMpolBind, &options.memoryNodes, sizeof(unsigned long) * 8 + 1) != 0) {
    fail(errno);
  }
  ::execve(program, argv, envp);
  fail(errno);
  ::_exit(127);
}

}  // namespace

ChildProcess ChildProcess::spawn(const SpawnOptions& options) {
  if (options.argv.empty()) throw ConfigError("spawn: empty command line");
  std::string why;
  const auto program = findExecutable(options.argv[0], &why);
  if (!program) throw ConfigError("cannot run '" + options.argv[0] + "': " + why);
  auto argv = cStrings(options.argv);
  auto envp = cStrings(options.env);

  std::array<int, 2> pipeFds{};
  if (::pipe2(pipeFds.data(), O_CLOEXEC) != 0) throwErrno("spawn: pipe2", errno);
  Fd readEnd(pipeFds[0]);
  Fd writeEnd(pipeFds[1]);

#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer keeps shadow memory for every stack: a child sharing the parent's memory
  // would write into the parent's. Sanitizer builds pay for a real fork.
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throwErrno("spawn " + options.argv[0] + ": fork", errno);
  if (pid == 0) {
    childAfterFork(options, parent, program->c_str(), argv.data(), envp.data(), writeEnd.get());
  }
#else
  // clone(CLONE_VM | CLONE_VFORK), as posix_spawn does: no copy of the parent's page tables,
  // which costs tens of milliseconds in a process that maps LibTorch. The child runs on its own
  // stack with every signal blocked until it has reset their dispositions; the parent resumes
  // once the child has exec'd (or failed to).
  struct Args {
    const SpawnOptions* options;
    pid_t parent;
    const char* program;
    char* const* argv;
    char* const* envp;
    int errorPipe;
  } args{&options, ::getpid(), program->c_str(), argv.data(), envp.data(), writeEnd.get()};
  constexpr std::size_t kStackBytes = 256 * 1024;
  void* stack = ::mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
  if (stack == MAP_FAILED) throwErrno("spawn " + options.argv[0] + ": mmap of the child's stack", errno);
  sigset_t all;
  sigset_t previous;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &previous);
  const pid_t pid = ::clone(
      [](void* raw) -> int {
        const auto* a = static_cast<const Args*>(raw);
        childAfterFork(*a->options, a->parent, a->program, a->argv, a->envp, a->errorPipe);
      },
      static_cast<char*>(stack) + kStackBytes, CLONE_VM | CLONE_VFORK | SIGCHLD, &args);
  const int cloneErrno = errno;
  ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  ::munmap(stack, kStackBytes);
  if (pid < 0) throwErrno("spawn " + options.argv[0] + ": clone", cloneErrno);
#endif
  ChildProcess child(pid, options.newProcessGroup);
  // Also from the parent, so that signal() works even before the child ran setpgid.
  if (options.newProcessGroup) ::setpgid(pid, pid);
  writeEnd.reset();
  int childErrno = 0;
  ssize_t n;
  do {
    n = ::read(readEnd.get(), &childErrno, sizeof(childErrno));
  } while (n < 0 && errno == EINTR);
  if (n == sizeof(childErrno)) {
    child.waitFor(std::chrono::seconds(5));
    const std::string what = errnoMessage("cannot execute '" + *program + "'", childErrno);
    // The program itself is unusable (a usage problem), as opposed to a system failure.
    if (childErrno == ENOEXEC || childErrno == EACCES || childErrno == ENOENT) throw ConfigError(what);
    throw Error(what);
  }
  return child;
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(other.pid_), ownGroup_(other.ownGroup_), status_(other.status_) {
  other.pid_ = -1;
}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    release();
    pid_ = other.pid_;
    ownGroup_ = other.ownGroup_;
    status_ = other.status_;
    other.pid_ = -1;
  }
  return *this;
}

ChildProcess::~ChildProcess() { release(); }

void ChildProcess::release() noexcept {
  if (pid_ <= 0 || status_) return;
  signal(SIGKILL);
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
}

std::optional<int> ChildProcess::tryWait() {
  if (status_ || pid_ <= 0) return status_;
  int status = 0;
  pid_t r;
  do {
    r = ::waitpid(pid_, &status, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == pid_) status_ = status;
  return status_;
}

std::optional<int> ChildProcess::waitFor(std::chrono::milliseconds timeout) {
  if (tryWait()) return status_;
  Fd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0)));
  if (pidfd.get() < 0) throwErrno("pidfd_open " + std::to_string(pid_), errno);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (tryWait()) return status_;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    pollfd pfd{pidfd.get(), POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(left.count()));
    if (r < 0 && errno != EINTR) throwErrno("poll pidfd", errno);
  }
}

void ChildProcess::signal(int sig) {
  if (pid_ <= 0 || status_) return;
  if (ownGroup_ && ::kill(-pid_, sig) == 0) return;
  ::kill(pid_, sig);
}

std::string signalName(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  if (abbrev == nullptr) return "signal " + std::to_string(sig);
  return std::string("SIG") + abbrev;
}

std::optional<int> parseSignal(const std::string& text) {
  if (text.empty()) return std::nullopt;
  if (std::isdigit(static_cast<unsigned char>(text[0]))) {
    const int sig = std::atoi(text.c_str());
    if (sig > 0 && sig < NSIG && std::to_string(sig) == text) return sig;
    return std::nullopt;
  }
  const std::string name = text.rfind("SIG", 0) == 0 ? text.substr(3) : text;
  for (int sig = 1; sig < NSIG; ++sig) {
    const char* abbrev = ::sigabbrev_np(sig);
    if (abbrev != nullptr && name == abbrev) return sig;
  }
  return std::nullopt;
}

std::string describeWaitStatus(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "signal " + signalName(sig) + " (" + std::to_string(sig) + ")";
  }
  return "wait status " + std::to_string(status);
}

double peakRssMb() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

std::string readLineWithin(int fd, std::chrono::milliseconds timeout) {
  std::string line;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (line.find('\n') == std::string::npos) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd pfd{fd, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) break;
    char buf[256];
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    line.append(buf, static_cast<std::size_t>(n));
  }
  return line;
}

double processAgeSeconds() {
  std::ifstream stat("/proc/self/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');
  std::ifstream uptimeFile("/proc/uptime");
  double uptime = -1;
  uptimeFile >> uptime;
  if (close == std::string::npos || uptime < 0) return -1;
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  // Fields after the command: state is field 3; starttime is field 22 (clock ticks since boot).
  for (int i = 3; i < 22 && fields >> field; ++i) {
  }
  unsigned long long ticks = 0;
  if (!(fields >> ticks)) return -1;
  return uptime - static_cast<double>(ticks) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

void raiseDescriptorLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &limit);
  }
}

void reserveDescriptorTable(std::size_t slots) {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  slots = std::min<std::size_t>({slots, limit.rlim_cur, std::size_t{1} << 24});
  if (slots <= 64) return;  // the table's first size
  // Some descriptor duplicated into the top slot and closed again: F_DUPFD takes the lowest
  // free slot at or above it, so nothing open is replaced.
  const Fd any(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (any.get() < 0) return;
  const Fd top(::fcntl(any.get(), F_DUPFD_CLOEXEC, static_cast<int>(slots) - 1));
}

std::vector<std::string> currentEnvironment() {
  std::vector<std::string> out;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) out.emplace_back(*e);
  return out;
}

std::optional<std::string> findExecutable(const std::string& program, std::string* why) {
  auto check = [why](const std::string& path) -> bool {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      if (why) *why = std::strerror(errno);
      return false;
    }
    if (!S_ISREG(st.st_mode)) {
      if (why) *why = "not a regular file";
      return false;
    }
    if (::access(path.c_str(), X_OK) != 0) {
      if (why) *why = "not executable (" + std::string(std::strerror(errno)) + ")";
      return false;
    }
    return true;
  };
  if (program.empty()) {
    if (why) *why = "empty program name";
    return std::nullopt;
  }
  if (program.find('/') != std::string::npos) {
    if (check(program)) return program;
    return std::nullopt;
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  std::size_t start = 0;
  while (start <= dirs.size()) {
    const auto end = std::min(dirs.find(':', start), dirs.size());
    std::string dir = dirs.substr(start, end - start);
    if (dir.empty()) dir = ".";
    const std::string candidate = dir + "/" + program;
    if (check(candidate)) return candidate;
    start = end + 1;
  }
  if (why) *why = "not found in PATH";
  return std::nullopt;
}

}  // namespace fsdp
