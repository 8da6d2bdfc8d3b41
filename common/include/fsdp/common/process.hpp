#pragma once
// Child processes with one owner. A ChildProcess that is destroyed while its process still
// runs kills the process group with SIGKILL and reaps it, so no code path leaks a child.

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include <sched.h>

namespace fsdp {

struct SpawnOptions {
  std::vector<std::string> argv;      // argv[0] is the program, looked up in PATH if it has no '/'
  std::vector<std::string> env;       // full environment, "KEY=VALUE"
  bool newProcessGroup = true;        // setpgid(0, 0): signals reach the child's whole tree
  int deathSignal = 9;                // PR_SET_PDEATHSIG: sent when the parent thread dies; 0 = none
  std::optional<std::string> stdoutPath;  // redirect (truncate) when set
  std::optional<std::string> stderrPath;
  std::optional<int> stdoutFd;            // dup2'ed onto stdout when set (e.g. a pipe's write end)
  std::optional<int> stderrFd;            // dup2'ed onto stderr when set
  std::optional<int> stdinFd;             // dup2'ed onto stdin when set
  std::optional<cpu_set_t> cpuAffinity;   // sched_setaffinity before exec when set
  unsigned long memoryNodes = 0;          // set_mempolicy(MPOL_BIND) to these NUMA nodes (bit n: node n); 0: none
};

class ChildProcess {
 public:
  // Starts the process. Throws Error naming the program when it cannot be executed (the
  // exec failure is reported back through a close-on-exec pipe, not guessed).
  static ChildProcess spawn(const SpawnOptions& options);

  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();

  pid_t pid() const noexcept { return pid_; }
  bool reaped() const noexcept { return status_.has_value(); }
  // The wait status once reaped.
  std::optional<int> status() const noexcept { return status_; }

  // Reaps without blocking; returns the wait status when the process has exited.
  std::optional<int> tryWait();
  // Waits at most `timeout` for the process to exit (pidfd + poll, no sleeping loop).
  std::optional<int> waitFor(std::chrono::milliseconds timeout);
  // Sends `sig` to the process group (or the process if it has none of its own). No-op once
  // reaped.
  void signal(int sig);

 private:
  ChildProcess(pid_t pid, bool ownGroup) : pid_(pid), ownGroup_(ownGroup) {}
  void release() noexcept;
  pid_t pid_ = -1;
  bool ownGroup_ = true;
  std::optional<int> status_;
};

// "exit code 3" or "signal SIGKILL (9)" for a wait status.
std::string describeWaitStatus(int status);

// "SIGTERM" for 15; "signal 77" for unknown numbers.
std::string signalName(int sig);

// Parses "SIGTERM", "TERM" or "15"; nullopt if unknown.
std::optional<int> parseSignal(const std::string& text);

// The current environment as "KEY=VALUE" strings.
std::vector<std::string> currentEnvironment();

// This process's peak resident set so far, in MiB (getrusage's ru_maxrss).
double peakRssMb();

// Seconds since this process started (from /proc/self/stat and /proc/uptime); -1 if unknown.
double processAgeSeconds();

// Reads `fd` until a newline has arrived, `timeout` has passed or the writer closed it, and
// returns what it read (possibly more than one line, possibly no newline at all). For a child's
// first line on a pipe, such as "fsdprun-rdzv: listening on HOST:PORT".
std::string readLineWithin(int fd, std::chrono::milliseconds timeout);

// Raises this process's soft RLIMIT_NOFILE to its hard one (the soft one is often 1,024, too
// few for a server of thousands of connections). Children inherit it.
void raiseDescriptorLimit();

// Grows this process's descriptor table now to `slots` (capped by the soft RLIMIT_NOFILE and
// by 2^24), so that it does not grow while connections come: a table shared by threads grows
// by doubling, and every doubling makes the thread that opens a descriptor wait an RCU grace
// period (milliseconds in a VM) while the others opening one sleep. 8 bytes per slot, once.
// Best effort: without /dev/null to duplicate, nothing happens.
void reserveDescriptorTable(std::size_t slots);

// Resolves a program as execvp would (PATH lookup when there is no '/'); nullopt when no
// executable file is found. Sets `why` to a human reason on failure.
std::optional<std::string> findExecutable(const std::string& program, std::string* why);

}  // namespace fsdp
