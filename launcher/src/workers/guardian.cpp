#include "guardian.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"

namespace fsdp::launcher::detail {
namespace {

constexpr int kWatch = 1;
constexpr int kForget = 2;
constexpr int kMaxGroups = 65536;

struct Message {
  int op;
  pid_t pgid;
};

// Runs in the forked child: only async-signal-safe calls.
[[noreturn]] void guard(int readFd) {
  ::setpgid(0, 0);  // off the agent's group: a terminal's Ctrl-C is the agent's to handle
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGPIPE}) ::signal(sig, SIG_IGN);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  // Hold nothing of the agent's: its console (a pipe someone reads to EOF), its sockets.
  const int devnull = ::open("/dev/null", O_RDWR);
  if (devnull >= 0) {
    ::dup2(devnull, 0);
    ::dup2(devnull, 1);
    ::dup2(devnull, 2);
  }
  ::dup2(readFd, 3);
  ::syscall(SYS_close_range, 4u, ~0u, 0u);
  static std::array<pid_t, kMaxGroups> groups{};
  int count = 0;
  Message m{};
  for (;;) {
    const ssize_t n = ::read(3, &m, sizeof(m));
    if (n < 0 && errno == EINTR) continue;
    if (n != static_cast<ssize_t>(sizeof(m))) break;  // EOF: the agent is gone
    if (m.op == kWatch && count < kMaxGroups) {
      groups[count++] = m.pgid;
    } else if (m.op == kForget) {
      for (int i = 0; i < count; ++i) {
        if (groups[i] == m.pgid) {
          groups[i] = groups[--count];
          break;
        }
      }
    }
  }
  for (int i = 0; i < count; ++i) ::kill(-groups[i], SIGKILL);
  ::_exit(0);
}

}  // namespace

Guardian::Guardian() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throwErrno("pipe2 for the guardian", errno);
  pid_ = ::fork();
  if (pid_ < 0) {
    const int err = errno;
    ::close(fds[0]);
    ::close(fds[1]);
    throwErrno("fork of the guardian", err);
  }
  if (pid_ == 0) {
    ::close(fds[1]);
    guard(fds[0]);
  }
  ::close(fds[0]);
  fd_ = fds[1];
}

Guardian::~Guardian() {
  ::close(fd_);
  // The guardian exits on EOF; reap it so that it is not left a zombie of a long-lived caller.
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
}

void Guardian::watch(pid_t pgid) { send(kWatch, pgid); }

void Guardian::forget(pid_t pgid) { send(kForget, pgid); }

void Guardian::send(int op, pid_t pgid) {
  const Message m{op, pgid};
  ssize_t n;
  do {
    n = ::write(fd_, &m, sizeof(m));
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(sizeof(m))) {
    log::warn("the guardian of the workers' process groups is gone: a SIGKILL of fsdprun may "
              "leave grandchildren of workers behind");
  }
}

}  // namespace fsdp::launcher::detail
