#pragma once
// Test helpers about processes: pid files written by workers, liveness, and /proc scans that
// find whatever a job left behind.

#include <chrono>
#include <string>
#include <vector>

namespace fsdp::testing {

// Reads <dir>/<name>.pid for every name, waiting (bounded) until all exist; empty on timeout.
std::vector<int> waitForPidFiles(const std::string& dir, const std::vector<std::string>& names,
                                 std::chrono::milliseconds timeout);

// Whether `pid` is gone (or a zombie) within `within`.
bool processGone(int pid, std::chrono::milliseconds within);

// Live (non-zombie) processes whose environment holds `entry` ("KEY=VALUE").
std::vector<int> processesWithEnvironment(const std::string& entry);

// Live (non-zombie) processes in process group `pgid`.
std::vector<int> processGroupMembers(int pgid);

// The first number after `label` in a /proc file ("/proc/self/status", "FDSize:"; "limits",
// "Max open files" gives the soft limit); -1 when the label or a number is missing.
long procNumber(const std::string& path, const std::string& label);

// A TCP port free on 127.0.0.1 right now (bind to port 0, read it back).
int freeLoopbackPort();

// The parent pid of `pid` (from /proc/<pid>/stat), or -1.
int parentOf(int pid);

// Whether the agent's stack tools are installed (eu-stack, else gdb): hang reports carry stacks.
bool haveStackTool();

// A listening socket on 127.0.0.1 that never accepts or answers: a foreign service holding a
// port. Closed by the destructor.
class SilentListener {
 public:
  SilentListener();
  ~SilentListener();
  SilentListener(const SilentListener&) = delete;
  SilentListener& operator=(const SilentListener&) = delete;
  int port() const { return port_; }

 private:
  int port_ = 0;  // before fd_: fd_'s initializer fills it
  int fd_ = -1;
};

}  // namespace fsdp::testing
