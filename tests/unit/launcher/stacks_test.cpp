// inspectProcess against real children of this test: spinning, blocked in read(), stopped by
// SIGSTOP, in uninterruptible sleep, and already reaped.
#include "hang/stacks.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

#include "fsdp/common/process.hpp"
#include "fsdp/common/snapshot_wire.hpp"
#include "processes.hpp"

using fsdp::launcher::detail::inspectProcess;
using namespace std::chrono_literals;

namespace {

void say(int fd, const char* line) {
  [[maybe_unused]] auto n = ::write(fd, line, std::char_traits<char>::length(line));
}

}  // namespace

// What the children run, under names no library has. Each says `line` on `readyFd` from inside
// itself, so that the test, once it has read the line, finds the function on the stack.
extern "C" __attribute__((noinline)) void fsdpStacksTestSpinsHere(int readyFd, const char* line) {
  say(readyFd, line);
  volatile unsigned long n = 0;
  for (;;) n = n + 1;
}

extern "C" __attribute__((noinline)) void fsdpStacksTestReadsHere(int readyFd, const char* line,
                                                                  int fd) {
  say(readyFd, line);
  char c;
  [[maybe_unused]] auto n = ::read(fd, &c, 1);
  ::_exit(0);
}

namespace {

constexpr auto kInspectTimeout = 20s;  // gdb, the fallback, needs a few hundred ms
constexpr auto kEventTimeout = 10s;

struct Pipe {
  Pipe() {
    std::array<int, 2> fds{};
    if (::pipe2(fds.data(), O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    in = fsdp::snapshot::Fd(fds[0]);
    out = fsdp::snapshot::Fd(fds[1]);
  }
  fsdp::snapshot::Fd in;
  fsdp::snapshot::Fd out;
};

// A forked child running `body`; killed and reaped when the test ends, however it ends.
class Child {
 public:
  template <typename Body>
  explicit Child(Body body) : pid_(::fork()) {
    if (pid_ == 0) {
      body();
      ::_exit(0);
    }
  }
  ~Child() { reap(); }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  pid_t pid() const { return pid_; }
  void reap() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_;
};

// Field 3 of /proc/<pid>/stat, read directly (no tool attaches).
char stateOf(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  const std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = stat.rfind(')');
  return close == std::string::npos || close + 2 >= stat.size() ? '?' : stat[close + 2];
}

using fsdp::testing::haveStackTool;

constexpr const char* kNoTool = "neither eu-stack (elfutils) nor gdb is installed";

}  // namespace

TEST(InspectProcess, SpinningProcessIsRunningInItsFunction) {
  if (!haveStackTool()) GTEST_SKIP() << kNoTool;
  Pipe ready;
  Child child([&] { fsdpStacksTestSpinsHere(ready.out.get(), "spinning\n"); });
  ready.out.reset();
  ASSERT_EQ(fsdp::readLineWithin(ready.in.get(), kEventTimeout), "spinning\n");
  const auto r = inspectProcess(child.pid(), kInspectTimeout);
  EXPECT_EQ(r.state, 'R');
  EXPECT_EQ(r.stateName, "running");
  EXPECT_NE(r.stack.find("thread " + std::to_string(child.pid()) + ":"), std::string::npos)
      << r.stack;
  EXPECT_NE(r.stack.find("fsdpStacksTestSpinsHere"), std::string::npos) << r.stack << r.stackError;
}

TEST(InspectProcess, ProcessBlockedInReadIsSleepingInItsFunction) {
  if (!haveStackTool()) GTEST_SKIP() << kNoTool;
  Pipe ready;
  Pipe never;  // nothing is ever written: the child blocks in read() until killed
  Child child([&] { fsdpStacksTestReadsHere(ready.out.get(), "reading\n", never.in.get()); });
  ready.out.reset();
  ASSERT_EQ(fsdp::readLineWithin(ready.in.get(), kEventTimeout), "reading\n");
  // No kernel event says that a process went to sleep: the child enters read() microseconds
  // after it said so, and a look in between (1 in ~1,000 here) still finds it running.
  auto r = inspectProcess(child.pid(), kInspectTimeout);
  for (int look = 1; r.state == 'R' && look < 5; ++look)
    r = inspectProcess(child.pid(), kInspectTimeout);
  EXPECT_EQ(r.state, 'S');
  EXPECT_EQ(r.stateName, "sleeping");
  EXPECT_NE(r.stack.find("fsdpStacksTestReadsHere"), std::string::npos) << r.stack << r.stackError;
}

TEST(InspectProcess, StoppedProcessGivesItsStackAndStaysStopped) {
  if (!haveStackTool()) GTEST_SKIP() << kNoTool;
  Pipe ready;
  Child child([&] { fsdpStacksTestSpinsHere(ready.out.get(), "spinning\n"); });
  ready.out.reset();
  ASSERT_EQ(fsdp::readLineWithin(ready.in.get(), kEventTimeout), "spinning\n");
  ASSERT_EQ(::kill(child.pid(), SIGSTOP), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child.pid(), &status, WUNTRACED), child.pid());
  ASSERT_TRUE(WIFSTOPPED(status));

  const auto r = inspectProcess(child.pid(), kInspectTimeout);
  EXPECT_EQ(r.state, 'T');
  EXPECT_EQ(r.stateName, "stopped (SIGSTOP)");
  EXPECT_NE(r.stack.find("fsdpStacksTestSpinsHere"), std::string::npos) << r.stack << r.stackError;
  // A spinning child that the tool's detach had resumed would read 'R' here.
  EXPECT_EQ(stateOf(child.pid()), 'T');
}

TEST(InspectProcess, UninterruptibleProcessIsNotTracedAndNotLeftStopped) {
  Pipe events;
  Pipe release;
  // The child vforks: until its vfork child exits, it sleeps uninterruptibly (D), where
  // ptrace would wait for it and leave it a SIGSTOP to take when it wakes.
  Child child([&] {
    release.out.reset();  // so that the vfork child reads EOF once the test closes its end
    if (::vfork() == 0) {
      fsdpStacksTestReadsHere(events.out.get(), "vforked\n", release.in.get());
    }
    fsdpStacksTestSpinsHere(events.out.get(), "resumed\n");
  });
  events.out.reset();
  release.in.reset();
  ASSERT_EQ(fsdp::readLineWithin(events.in.get(), kEventTimeout), "vforked\n");

  const auto r = inspectProcess(child.pid(), kInspectTimeout);
  EXPECT_EQ(r.state, 'D');
  EXPECT_EQ(r.stateName, "uninterruptible sleep (D)");
  EXPECT_EQ(r.stack, "");
  EXPECT_NE(r.stackError.find("uninterruptible sleep"), std::string::npos) << r.stackError;
  release.out.reset();  // the vfork child reads EOF and exits; the child must run on
  EXPECT_EQ(fsdp::readLineWithin(events.in.get(), kEventTimeout), "resumed\n");
}

TEST(InspectProcess, ReapedProcessIsGoneWithoutThrowing) {
  Child child([] {});
  const pid_t pid = child.pid();
  child.reap();
  fsdp::launcher::detail::ProcessInspection r;
  ASSERT_NO_THROW(r = inspectProcess(pid, kInspectTimeout));
  EXPECT_EQ(r.pid, pid);
  EXPECT_EQ(r.state, '?');
  EXPECT_EQ(r.stateName, "gone");
  EXPECT_EQ(r.stack, "");
  EXPECT_NE(r.stackError.find("gone"), std::string::npos) << r.stackError;
}
