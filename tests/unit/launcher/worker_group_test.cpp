// What the agent does with processes no one waits for (launcher/src/workers/worker_group.hpp):
// every thread of a dying process lowered to nice 19 for its teardown, and a standby group's
// spares retired (killed, reaped later) without the caller blocking on their teardown.
#include "workers/worker_group.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "processes.hpp"
#include "run_command.hpp"
#include "workers/guardian.hpp"

using namespace std::chrono_literals;
namespace detail = fsdp::launcher::detail;

namespace {

// The nice value of each thread of `pid` (field 19 of /proc/<pid>/task/<tid>/stat).
std::vector<int> threadNices(pid_t pid) {
  std::vector<int> nices;
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* tasks = ::opendir(dir.c_str());
  if (tasks == nullptr) return nices;
  while (const dirent* e = ::readdir(tasks)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream in(dir + "/" + e->d_name + "/stat");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto close = text.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(text.substr(close + 2));  // from field 3, the state
    std::string field;
    for (int i = 3; i <= 19 && fields >> field; ++i) {
      if (i == 19) nices.push_back(std::stoi(field));
    }
  }
  ::closedir(tasks);
  return nices;
}

void* parkThread(void*) {
  for (;;) ::pause();
}

}  // namespace

TEST(WorkerTeardown, EveryThreadOfTheProcessGoesToNiceNineteen) {
  int ready[2];
  ASSERT_EQ(::pipe2(ready, O_CLOEXEC), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    for (int i = 0; i < 3; ++i) {
      pthread_t t;
      if (::pthread_create(&t, nullptr, parkThread, nullptr) != 0) ::_exit(3);
    }
    [[maybe_unused]] auto n = ::write(ready[1], "x", 1);
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1) << "the child did not start its threads";
  ::close(ready[0]);
  const auto before = threadNices(child);
  ASSERT_EQ(before.size(), 4u);
  for (const int nice : before) {
    if (nice >= 19) GTEST_SKIP() << "this test already runs at nice " << nice << ": nothing to lower";
  }

  detail::tearDownAtLowestPriority(child);
  const auto after = threadNices(child);
  EXPECT_EQ(after, std::vector<int>(4, 19));

  ::kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  // A process gone already: nothing to lower, no error.
  detail::tearDownAtLowestPriority(child);
}

TEST(WorkerGroupRetire, SparesAreKilledAndReapedLaterWithoutTheCallerWaiting) {
  fsdp::testing::TempDir dir;
  detail::Guardian guardian;
  std::vector<detail::WorkerSpec> specs;
  for (int localRank = 0; localRank < 2; ++localRank) {
    detail::WorkerSpec spec;
    spec.localRank = localRank;
    spec.rank = localRank;
    // Each blocks SIGTERM: only the SIGKILL of retire() ends it.
    spec.argv = {"/bin/sh", "-c", "trap '' TERM; while :; do sleep 1; done"};
    spec.env = {"PATH=/usr/bin:/bin"};
    specs.push_back(spec);
  }
  detail::WorkerGroup spares(specs, {}, dir.path() + "/attempt_0", guardian, /*standby=*/true);
  const auto pids = spares.pids();
  ASSERT_EQ(pids.size(), 2u);
  EXPECT_FALSE(spares.reapedAll());

  std::vector<int> exits;  // pidfds: readable once the process has exited
  for (const pid_t pid : pids) {
    exits.push_back(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
    ASSERT_GE(exits.back(), 0);
  }
  spares.retire();
  for (const int fd : exits) {
    pollfd exited{fd, POLLIN, 0};
    ASSERT_EQ(::poll(&exited, 1, 30000), 1) << "a retired spare did not exit";
    ::close(fd);
  }
  EXPECT_TRUE(spares.reapedAll());
  for (const pid_t pid : pids) {
    EXPECT_NE(::kill(pid, 0), 0) << "pid " << pid << " is still there (not even a zombie may remain)";
  }
  // Retired again, or destroyed: nothing left to kill or wait for.
  spares.retire();
  EXPECT_TRUE(spares.reapedAll());
}
