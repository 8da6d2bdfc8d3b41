// Takes a live process's state from /proc and every thread's native stack with eu-stack or gdb,
// both under one deadline (see stacks.hpp).
#include "stacks.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "fsdp/common/deadline.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/common/snapshot_wire.hpp"

namespace fsdp::launcher::detail {
namespace {

using snapshot::Fd;

constexpr std::size_t kMaxKernelFrames = 8;

// A /proc file (or a memfd through /proc/self/fd, read from its start); nullopt when it cannot
// be opened, such as a process's files once it is gone.
std::optional<std::string> readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

// Field 3 of /proc/<pid>[/task/<tid>]/stat, after the parenthesised name (which may itself
// hold spaces and parentheses); nullopt when the file is gone.
std::optional<char> readState(const std::string& dir) {
  const auto stat = readFile(dir + "/stat");
  if (!stat) return std::nullopt;
  const auto close = stat->rfind(')');
  if (close == std::string::npos || close + 2 >= stat->size()) return std::nullopt;
  return (*stat)[close + 2];
}

// "thread 812 (kernel_clone+0x1af/0x3e0 <- __do_sys_vfork+0x43/0x70 <- ...)": where a thread in
// D waits, from its kernel stack (root only) or else its wchan.
std::string describeKernelWait(const std::string& dir, const std::string& tid) {
  const std::string taskDir = dir + "/task/" + tid;
  std::string where;
  if (const auto stack = readFile(taskDir + "/stack")) {
    std::istringstream lines(*stack);
    std::string line;
    for (std::size_t n = 0; n < kMaxKernelFrames && std::getline(lines, line); ++n) {
      const auto bracket = line.find("] ");
      where += (where.empty() ? "" : " <- ") +
               (bracket == std::string::npos ? line : line.substr(bracket + 2));
    }
  }
  if (where.empty()) where = "in " + readFile(taskDir + "/wchan").value_or("?");
  return "thread " + tid + " (" + where + ")";
}

struct ToolRun {
  std::optional<int> status;  // the wait status; nullopt when it did not run or finish
  bool timedOut = false;
  std::string out;
  std::string err;
  std::string failure;  // why it did not run or finish
};

Fd captureFile(const char* name) {
  Fd fd(::memfd_create(name, MFD_CLOEXEC));
  if (!fd) throwErrno(std::string("memfd_create for ") + name, errno);
  return fd;
}

std::string readBack(const Fd& fd) {
  return readFile("/proc/self/fd/" + std::to_string(fd.get())).value_or("");
}

// Runs `argv` until it exits or `deadline` passes; then it is killed with its process group and
// reaped. Output goes to memfds rather than a pipe, which could fill while we only wait.
ToolRun runTool(const std::vector<std::string>& argv, const Deadline& deadline) {
  ToolRun run;
  std::string why;
  if (!findExecutable(argv[0], &why)) {
    run.failure = argv[0] + " is not installed (" + why + ")";
    return run;
  }
  const Fd out = captureFile("fsdprun-stack-out");
  const Fd err = captureFile("fsdprun-stack-err");
  const Fd devNull(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  SpawnOptions options;
  options.argv = argv;
  // No debuginfod: a download from the network could take the whole deadline.
  for (auto& kv : currentEnvironment()) {
    if (kv.rfind("DEBUGINFOD_URLS=", 0) == 0 || kv.rfind("LC_ALL=", 0) == 0) continue;
    options.env.push_back(kv);
  }
  options.env.emplace_back("LC_ALL=C");  // gdb's "Thread N (... (LWP tid)" is parsed below
  options.stdoutFd = out.get();
  options.stderrFd = err.get();
  if (devNull) options.stdinFd = devNull.get();
  const auto start = Deadline::Clock::now();
  try {
    ChildProcess child = ChildProcess::spawn(options);
    run.status = child.waitFor(deadline.remaining());
    if (!run.status) {
      run.timedOut = true;
      run.failure = argv[0] + " timed out after " + std::to_string(elapsedMs(start)) + " ms";
    }
  } catch (const Error& e) {
    run.failure = e.what();
  }
  run.out = readBack(out);
  run.err = readBack(err);
  return run;
}

// What a tool said about why it failed: its diagnostic lines, joined and bounded.
std::string toolSaid(const ToolRun& run) {
  std::istringstream lines(run.err);
  std::string said;
  std::string line;
  while (std::getline(lines, line) && said.size() < 400) {
    line = trim(line);
    if (line.empty()) continue;
    said += (said.empty() ? "" : "; ") + line;
  }
  return said.empty() ? "no message" : said;
}

// eu-stack prints "TID 812:" then frames, each optionally followed by an indented source line;
// this keeps the frames with their source in parentheses.
std::string euStackText(const std::string& raw) {
  std::istringstream lines(raw);
  std::string text;
  std::string line;
  bool afterFrame = false;
  while (std::getline(lines, line)) {
    if (line.rfind("TID ", 0) == 0) {
      text += "thread " + line.substr(4) + "\n";
      afterFrame = false;
    } else if (line.rfind('#', 0) == 0) {
      text += line + "\n";
      afterFrame = true;
    } else if (afterFrame && line.rfind("    ", 0) == 0 && !text.empty()) {
      text.insert(text.size() - 1, " (" + trim(line) + ")");
    } else if (line.rfind("PID ", 0) != 0 && !trim(line).empty()) {
      text += line + "\n";
    }
  }
  return text.find('#') == std::string::npos ? "" : text;
}

// gdb prints "Thread 2 (Thread 0x7f... (LWP 812) "name"):" then frames, among messages about
// symbols and the current source line, which are dropped.
std::string gdbText(const std::string& raw) {
  std::istringstream lines(raw);
  std::string text;
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("Thread ", 0) == 0) {
      const std::string key = line.find("(LWP ") != std::string::npos ? "(LWP " : "(process ";
      const auto at = line.find(key);
      if (at == std::string::npos) continue;
      const auto begin = at + key.size();
      const auto end = line.find_first_not_of("0123456789", begin);
      text += "thread " + line.substr(begin, end - begin) + ":\n";
    } else if (line.rfind('#', 0) == 0) {
      text += line + "\n";
    }
  }
  return text.find('#') == std::string::npos ? "" : text;
}

}  // namespace

char processState(pid_t pid) {
  return pid > 0 ? readState("/proc/" + std::to_string(pid)).value_or('?') : '?';
}

std::string processStateName(char state) {
  // clang-format off
  static constexpr std::pair<char, const char*> kNames[] = {
      {'R', "running"}, {'S', "sleeping"}, {'D', "uninterruptible sleep (D)"},
      {'T', "stopped (SIGSTOP)"}, {'t', "traced"}, {'Z', "zombie"}, {'X', "dead"}, {'I', "idle"},
      {'?', "gone"}};
  // clang-format on
  for (const auto& [letter, name] : kNames) {
    if (letter == state) return name;
  }
  return std::string("state ") + state;
}

ProcessInspection inspectProcess(pid_t pid, std::chrono::milliseconds timeout) {
  const Deadline deadline = Deadline::after(timeout);
  const std::string dir = "/proc/" + std::to_string(pid);
  ProcessInspection r;
  r.pid = pid;
  r.state = pid > 0 ? readState(dir).value_or('?') : '?';
  r.stateName = processStateName(r.state);
  if (r.state == '?') {
    r.stackError = "process " + std::to_string(pid) + " is gone (no " + dir + "/stat)";
    return r;
  }
  if (const auto wchan = readFile(dir + "/wchan"); wchan && *wchan != "0") r.wchan = *wchan;

  std::size_t threads = 0;
  std::string blocked;  // threads in D, where ptrace would wait
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator(dir + "/task", ec)) {
    const auto state = readState(task.path().string());
    threads += state.has_value();
    if (state == 'D') {
      blocked +=
          (blocked.empty() ? "" : ", ") + describeKernelWait(dir, task.path().filename().string());
    }
  }
  if ((r.state == 'Z' || r.state == 'X') && threads <= 1) {
    r.stackError = "process " + std::to_string(pid) + " has exited and is a " + r.stateName +
                   " (its parent has not reaped it)";
    return r;
  }
  if (!blocked.empty()) {
    r.stackError =
        "not traced: ptrace would wait for the threads in uninterruptible sleep (D) "
        "to wake, and its SIGSTOP would stop the process later; kernel stacks: ";
    r.stackError += blocked;
    return r;
  }

  const bool wasStopped = r.state == 'T' || r.state == 't';
  const std::string pidText = std::to_string(pid);
  // -i: inlined frames and function names from DWARF; -s: source file:line where known.
  const ToolRun eu = runTool({"eu-stack", "-p", pidText, "-i", "-s"}, deadline);
  // Exit code 1: some frames could not be unwound; the rest is shown.
  const bool euExitedOk = eu.status && WIFEXITED(*eu.status) && WEXITSTATUS(*eu.status) <= 1;
  if (euExitedOk) r.stack = euStackText(eu.out);
  if (!r.stack.empty()) return r;
  std::string euError = eu.failure;
  if (euError.empty()) {
    euError = euExitedOk ? "eu-stack printed no frames: "
                         : "eu-stack failed (" + describeWaitStatus(*eu.status) + "): ";
    euError += toolSaid(eu);
  }

  std::string gdbError;
  if (eu.timedOut || deadline.expired()) {
    gdbError = "gdb not tried: no time left of " + std::to_string(timeout.count()) + " ms";
  } else {
    const ToolRun gdb = runTool({"gdb", "-nx", "-batch", "-iex", "set debuginfod enabled off", "-p",
                                 pidText, "-ex", "thread apply all bt"},
                                deadline);
    r.stack = gdb.status ? gdbText(gdb.out) : "";
    if (!r.stack.empty()) return r;
    // gdb exits 0 in batch mode even when it could not attach; its messages say why.
    gdbError = gdb.failure.empty() ? "gdb printed no frames: " + toolSaid(gdb) : gdb.failure;
    if (gdb.timedOut && !wasStopped) ::kill(pid, SIGCONT);
  }
  // A killed tool may leave the SIGSTOP of its PTRACE_ATTACH pending; SIGCONT discards it.
  if (eu.timedOut && !wasStopped) ::kill(pid, SIGCONT);
  if (!readState(dir)) {
    r.state = '?';
    r.stateName = processStateName('?');
  }
  r.stackError = euError + "; " + gdbError;
  return r;
}

}  // namespace fsdp::launcher::detail
