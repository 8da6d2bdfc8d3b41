// The lifeline: the agent hears of a worker's exit from the kernel's release of a robust mutex
// (at the start of the exit), and /proc tells an exit from an exec. Each case forks a real child
// that takes the lifeline as fsdp::init() does.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "fsdp/common/lifeline.hpp"

namespace fsdp {
namespace {

struct Pipe {
  int fds[2] = {-1, -1};
  Pipe() { EXPECT_EQ(::pipe2(fds, O_CLOEXEC), 0); }
  ~Pipe() {
    for (const int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
  }
  int readEnd() const { return fds[0]; }
  int writeEnd() const { return fds[1]; }
};

// One byte from `fd` within 30 s (generous on a loaded machine, and inside the test timeout so
// that a failure is told), or nullopt.
std::optional<unsigned char> readByte(int fd, int timeoutMs = 30000) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, timeoutMs) != 1) return std::nullopt;
  unsigned char c = 0;
  if (::read(fd, &c, 1) != 1) return std::nullopt;
  return c;
}

// A child that takes the lifeline (as a worker's main thread does in fsdp::init()), says so on
// `ready`, then does `then`.
template <typename Then>
pid_t holder(const LifelineWatch& watch, int ready, Then then) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  ::setenv("FSDPRUN_LIFELINE_FD", std::to_string(watch.fd()).c_str(), 1);
  holdLifeline();
  const char ok = ::getenv("FSDPRUN_LIFELINE_FD") == nullptr ? 'y' : 'n';
  if (::write(ready, &ok, 1) != 1) ::_exit(99);
  then();
  ::_exit(0);
}

int waitStatus(pid_t pid) {
  int status = -1;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

TEST(Lifeline, AKilledHolderIsToldWithItsWaitStatus) {
  Pipe news;
  Pipe ready;
  LifelineWatch watch(news.writeEnd(), 7);
  const pid_t pid = holder(watch, ready.writeEnd(), [] {
    for (;;) ::pause();
  });
  ASSERT_EQ(readByte(ready.readEnd()), 'y') << "the child did not take its lifeline";
  EXPECT_EQ(exitingStatus(pid), std::nullopt) << "a running process reads as exiting";
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  EXPECT_EQ(readByte(news.readEnd()), 7);
  // Read before the child is reaped: the status waitpid will give.
  const auto early = exitingStatus(pid);
  const int status = waitStatus(pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  EXPECT_EQ(early, status);
}

TEST(Lifeline, AnExitCodeIsToldAsWaitpidGivesIt) {
  Pipe news;
  Pipe ready;
  LifelineWatch watch(news.writeEnd(), 3);
  // _exit, not exit: this child is forked from a process with threads (the watcher's), where
  // exit()'s handlers may wait on a lock a thread held at the fork (LeakSanitizer's on the
  // allocator hangs there under ASan). The kernel sees the same exit_group(3).
  const pid_t pid = holder(watch, ready.writeEnd(), [] { ::_exit(3); });
  ASSERT_EQ(readByte(ready.readEnd()), 'y');
  EXPECT_EQ(readByte(news.readEnd()), 3);
  const auto early = exitingStatus(pid);
  const int status = waitStatus(pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3);
  EXPECT_EQ(early, status);
}

TEST(Lifeline, AnExecReleasesItButIsNotAnExit) {
  Pipe news;
  Pipe ready;
  LifelineWatch watch(news.writeEnd(), 1);
  const pid_t pid = holder(watch, ready.writeEnd(), [] {
    ::execl("/bin/sleep", "sleep", "120", static_cast<char*>(nullptr));
    ::_exit(98);
  });
  ASSERT_EQ(readByte(ready.readEnd()), 'y');
  // The exec drops the old address space, and with it the robust list: the watcher hears.
  EXPECT_EQ(readByte(news.readEnd()), 1);
  EXPECT_EQ(exitingStatus(pid), std::nullopt) << "a process that went on after exec reads as exiting";
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  EXPECT_TRUE(WIFSIGNALED(waitStatus(pid)));
}

TEST(Lifeline, ASecondHolderGoesOnWithoutItAndAnUnheldOneEndsQuietly) {
  Pipe news;
  Pipe ready;
  LifelineWatch watch(news.writeEnd(), 5);
  const pid_t pid = holder(watch, ready.writeEnd(), [&] {
    // A child of the holder that inherited the variable must not block on the held mutex.
    const pid_t second = holder(watch, ready.writeEnd(), [] {});
    ::_exit(WIFEXITED(waitStatus(second)) ? 0 : 1);
  });
  ASSERT_EQ(readByte(ready.readEnd()), 'y');
  ASSERT_EQ(readByte(ready.readEnd()), 'y');
  const int status = waitStatus(pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(readByte(news.readEnd()), 5);  // the first holder's exit, once

  // Nobody ever takes this one: destroying the watch does not wait for anything.
  Pipe quiet;
  { LifelineWatch unused(quiet.writeEnd(), 9); }
  pollfd p{quiet.readEnd(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 0), 0) << "an unheld lifeline reported a death";
}

}  // namespace
}  // namespace fsdp
