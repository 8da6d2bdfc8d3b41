#pragma once
// The guardian: a small process forked when the agent starts, in its own process group, that
// holds the read end of a pipe from the agent and the list of the workers' process groups.
// When the agent dies, even by SIGKILL, the pipe reaches EOF and the guardian kills every
// group still listed, so that grandchildren of workers (a shell script's children, data
// loaders) never outlive the job. PR_SET_PDEATHSIG alone covers only the workers themselves.
//
// Thread-safety: none; the agent's thread owns it. Construct it before any thread exists.

#include <sys/types.h>

namespace fsdp::launcher::detail {

class Guardian {
 public:
  Guardian();
  // Closing the pipe tells the guardian that every group is gone; it exits.
  ~Guardian();
  Guardian(const Guardian&) = delete;
  Guardian& operator=(const Guardian&) = delete;

  // A worker's process group now exists / is gone (its leader reaped, the rest killed).
  void watch(pid_t pgid);
  void forget(pid_t pgid);

 private:
  void send(int op, pid_t pgid);
  int fd_ = -1;  // write end, close-on-exec
  pid_t pid_ = -1;
};

}  // namespace fsdp::launcher::detail
