// A worker for the fsdprun --standby tests (snapshot_test.cpp): prints one JSON line per rank
// and attempt, {"rank", "restart", "pid", "standby" (started as a spare), "next_standby" (the
// pid of the spare of its own rank for the next restart, once it is up)}, then:
//   rank 1, restart 0: waits for its spare to be up and SIGKILLs itself;
//   rank 0, restart 0: waits in a collective until the agent stops it;
//   later restarts: rank 1 waits for its next spare (while a restart is left), every rank
//   passes a barrier and exits 0.
// The spare is found as the agent's child whose environment holds FSDPRUN_STANDBY_FD, this
// rank and the next restart count; the wait ends on it, bounded by 60 s (then exit 3).
// STANDBY_WORKER_SPARES_FAIL=<dir>: every spare leaves before fsdp::init() (as a program whose
// start fails), its pid in <dir>/spare-<rank>-<restart>.pid, one line on stderr, exit code 4; rank 1
// of restart 0 then waits for its own spare to have exited instead of for it to be up.
#include <ATen/Functions.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "fsdp/worker/runtime.hpp"
#include "processes.hpp"

namespace {

using fsdp::testing::parentOf;

std::string environOf(const std::string& pid) {
  std::ifstream in("/proc/" + pid + "/environ");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (auto& c : text) {
    if (c == '\0') c = '\n';
  }
  return "\n" + text;
}

// The agent's child that is the spare of `rank` for restart `restart`, or -1.
int findStandby(int rank, int restart) {
  const std::string want = "\nRANK=" + std::to_string(rank) + "\n";
  const std::string count = "\nTORCHELASTIC_RESTART_COUNT=" + std::to_string(restart) + "\n";
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string pid = entry.path().filename();
    if (pid.find_first_not_of("0123456789") != std::string::npos || parentOf(std::stoi(pid)) != ::getppid()) continue;
    const std::string env = environOf(pid);
    if (env.find("\nFSDPRUN_STANDBY_FD=") != std::string::npos && env.find(want) != std::string::npos &&
        env.find(count) != std::string::npos) {
      return std::stoi(pid);
    }
  }
  return -1;
}

// STANDBY_WORKER_SPARES_FAIL: the pid of the spare of `rank` for restart `restart`, once it has
// exited; -1 after 60 s.
int failedSpare(const std::string& dir, int rank, int restart) {
  const auto pids = fsdp::testing::waitForPidFiles(
      dir, {"spare-" + std::to_string(rank) + "-" + std::to_string(restart)}, std::chrono::seconds(60));
  return !pids.empty() && fsdp::testing::processGone(pids[0], std::chrono::seconds(60)) ? pids[0] : -1;
}

}  // namespace

int main() {
  const bool startedAsStandby = std::getenv("FSDPRUN_STANDBY_FD") != nullptr;  // init() unsets it
  const char* sparesFail = std::getenv("STANDBY_WORKER_SPARES_FAIL");
  if (startedAsStandby && sparesFail != nullptr) {
    const std::string file = std::string(sparesFail) + "/spare-" + std::getenv("RANK") + "-" +
                             std::getenv("TORCHELASTIC_RESTART_COUNT") + ".pid";
    std::ofstream(file + ".part") << ::getpid() << "\n";
    std::filesystem::rename(file + ".part", file);
    std::fprintf(stderr, "standby_worker: this spare cannot start (STANDBY_WORKER_SPARES_FAIL)\n");
    return 4;
  }
  auto rt = fsdp::init();
  const int rank = rt->rank();
  const int restart = rt->env().restartCount;
  const int maxRestarts = std::atoi(std::getenv("TORCHELASTIC_MAX_RESTARTS"));
  int next = -1;
  if (rank == 1 && restart < maxRestarts && sparesFail != nullptr) {
    next = failedSpare(sparesFail, rank, restart + 1);
    if (next < 0) {
      std::fprintf(stderr, "standby_worker: the spare of rank 1 for restart %d did not exit\n", restart + 1);
      return 3;
    }
  } else if (rank == 1 && restart < maxRestarts) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while ((next = findStandby(rank, restart + 1)) < 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (next < 0) {
      std::fprintf(stderr, "standby_worker: no standby of rank 1 for restart %d appeared\n", restart + 1);
      return 3;
    }
  }
  std::printf("{\"rank\":%d,\"restart\":%d,\"pid\":%d,\"standby\":%s,\"next_standby\":%d}\n", rank, restart,
              static_cast<int>(::getpid()), startedAsStandby ? "true" : "false", next);
  std::fflush(stdout);
  if (restart == 0 && rank == 1) ::kill(::getpid(), SIGKILL);
  auto barrier = at::ones({1});
  rt->cpuComm().allReduce(barrier).wait();  // at restart 0, rank 0 waits here for the end
  return 0;
}
