#pragma once
// Python stacks of a worker that imported fsdprun's Python module: the agent gives each worker a
// memfd (FSDPRUN_PYSTACK_FD) and a signal number (FSDPRUN_PYSTACK_SIGNAL, SIGRTMIN + 6); the
// module registers faulthandler for that signal, writing every thread's Python stack into the
// memfd, and writes a first line "fsdprun-pystacks signal=<n> pid=<pid>" once registered.
// The agent sends the signal only to a worker that wrote that line (the signal's default action
// ends a process): faulthandler's handler runs in C, without the GIL, so a thread spinning in
// Python or blocked in a read still gets its stack taken. Private to the launcher.
//
// Thread-safety: a PyStackFile is read by one inspection at a time (the agent's watchdog thread,
// or its main thread after a failure).

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>

namespace fsdp::launcher::detail {

// The signal the module registers (the same number in every worker of a node).
int pyStackSignal();

class PyStackFile {
 public:
  // A new empty memfd, close-on-exec (the worker gets a duplicate). Throws Error.
  static std::shared_ptr<PyStackFile> create();
  ~PyStackFile();
  PyStackFile(const PyStackFile&) = delete;
  PyStackFile& operator=(const PyStackFile&) = delete;
  int fd() const { return fd_; }

 private:
  explicit PyStackFile(int fd) : fd_(fd) {}
  int fd_ = -1;
};

// Whether worker `pid` registered its Python stacks in `file`.
bool pythonStacksRegistered(const PyStackFile& file, pid_t pid);

// Asks worker `pid` for its Python stacks (the signal) and returns what faulthandler wrote, once
// the file has stopped growing; "" with `why` when the worker registered none, is stopped or
// gone, or wrote nothing within `timeout`.
std::string pythonStacks(const PyStackFile& file, pid_t pid, std::chrono::milliseconds timeout, std::string& why);

struct WatchedWorker;
// "Python:\n" and the worker's Python stacks, then `native`; just `native` for a worker without
// them (not a script that imported fsdprun, stopped, gone). Bounded by 2 s.
std::string withPythonStacks(const WatchedWorker& worker, const std::string& native);

}  // namespace fsdp::launcher::detail
