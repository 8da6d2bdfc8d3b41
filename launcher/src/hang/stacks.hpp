#pragma once
// What a live process is doing, for the hang report: its scheduler state from /proc and the
// native stack of every thread, taken by eu-stack (elfutils) or, failing that, gdb.
//
// Both tools attach with ptrace, from a sibling of the inspected process: that needs the same
// uid without Yama restrictions, or CAP_SYS_PTRACE. A process stopped by SIGSTOP stays stopped
// (both tools re-stop it on detach). A process with a thread in uninterruptible sleep (D) is
// not attached at all: ptrace would wait for that thread until it wakes, and the SIGSTOP that
// PTRACE_ATTACH queues would stop it later; its kernel stack is reported instead. When a tool
// runs past the deadline it is killed, and a process that was not stopped before gets a
// SIGCONT, which discards the SIGSTOP the tool's attach may have left pending.
//
// Thread-safety: inspectProcess is reentrant; it spawns children and reaps only those.

#include <sys/types.h>

#include <chrono>
#include <string>

namespace fsdp::launcher::detail {

struct ProcessInspection {
  pid_t pid = -1;
  char state = '?';       // /proc/<pid>/stat field 3: R S D T t Z X; '?' when unreadable
  std::string stateName;  // "running", "sleeping", "uninterruptible sleep (D)",
                          // "stopped (SIGSTOP)", "traced", "zombie", "gone", ...
  std::string wchan;      // /proc/<pid>/wchan when readable and waiting somewhere, else ""
  // Every thread's native stack: per thread a line "thread <tid>:" and the frames as the tool
  // prints them ("#0  0x... function (file:line)"). "" when none could be taken.
  std::string stack;
  // Why `stack` is empty: the tools tried and what each said, or why none was tried.
  std::string stackError;
};

// Inspects `pid` within `timeout` overall (both tools share it). Never throws for a process
// that is gone, a zombie or one that cannot be traced: the fields say so. Throws only on
// failures of this process itself (no memory, no file descriptors).
ProcessInspection inspectProcess(pid_t pid, std::chrono::milliseconds timeout);

// The /proc/<pid>/stat state letter of `pid` (R S D T t Z X); '?' when the process is gone.
char processState(pid_t pid);

// The human name of a /proc state letter ('?' gives "gone").
std::string processStateName(char state);

}  // namespace fsdp::launcher::detail
