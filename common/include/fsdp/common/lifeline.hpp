#pragma once
// A worker's lifeline: how its agent learns that the worker has begun to exit before the
// kernel has torn down its memory. A worker holding gigabytes (snapshot buffers, a model) takes
// hundreds of milliseconds in that teardown, and waitpid and the worker's pipes tell nothing
// until it is over; the agent would stop the other workers only then, and their teardowns
// would run one after the other.
//
// The agent gives each worker a page of shared memory (FSDPRUN_LIFELINE_FD, a memfd). The
// worker's main thread locks a robust, process-shared mutex there and never unlocks it. When
// the thread exits, the kernel releases the mutex (marking its owner dead) and wakes a waiter
// at the start of exit, before the address space goes; the agent's watcher thread is that
// waiter. The agent then confirms from /proc that the process is exiting and takes its exit
// status from there. A worker that never holds the lifeline (not a libfsdp program, or one that
// dies before fsdp::init()) is learnt of by waitpid as before.

#include <sys/types.h>

#include <atomic>
#include <optional>
#include <thread>

namespace fsdp {

// Worker side, called by fsdp::init(): takes the lifeline FSDPRUN_LIFELINE_FD names (and
// removes the variable), if any and if called on the main thread. Holds it for the life of
// the process. Never throws: without it the agent learns of an exit later, nothing else.
void holdLifeline();

// Agent side: one worker's lifeline and the thread that waits on it.
class LifelineWatch {
 public:
  // Creates the page and starts the watcher, which writes `token` (one byte) to `notifyFd`
  // when the holder dies. Throws Error when the memfd cannot be made.
  LifelineWatch(int notifyFd, unsigned char token);
  ~LifelineWatch();
  LifelineWatch(const LifelineWatch&) = delete;
  LifelineWatch& operator=(const LifelineWatch&) = delete;

  // The memfd (close-on-exec): the spawner hands a duplicate of it to the worker.
  int fd() const { return fd_; }

 private:
  void watch();
  int fd_ = -1;
  void* page_ = nullptr;
  int notifyFd_;
  unsigned char token_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The wait status of a process that has begun to exit (its main thread is past the point of
// no return: PF_EXITING, exit code set), read from /proc/<pid>/stat; nullopt while it runs or
// when /proc cannot say.
std::optional<int> exitingStatus(pid_t pid);

}  // namespace fsdp
