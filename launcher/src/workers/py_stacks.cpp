// Python stacks through faulthandler and a memfd (py_stacks.hpp).
#include "py_stacks.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <thread>

#include "fsdp/common/error.hpp"
#include "../hang/stacks.hpp"
#include "worker_group.hpp"

namespace fsdp::launcher::detail {
namespace {

using namespace std::chrono_literals;

std::size_t sizeOf(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 ? static_cast<std::size_t>(st.st_size) : 0;
}

// The first line, if the worker wrote it: its signal and pid.
bool readMarker(int fd, int& signal, long& pid) {
  char line[128] = {0};
  const ssize_t n = ::pread(fd, line, sizeof(line) - 1, 0);
  if (n <= 0) return false;
  return std::sscanf(line, "fsdprun-pystacks signal=%d pid=%ld", &signal, &pid) == 2;
}

}  // namespace

int pyStackSignal() { return SIGRTMIN + 6; }

std::shared_ptr<PyStackFile> PyStackFile::create() {
  const int fd = ::memfd_create("fsdprun-pystacks", MFD_CLOEXEC);
  if (fd < 0) throwErrno("memfd_create for a worker's Python stacks", errno);
  return std::shared_ptr<PyStackFile>(new PyStackFile(fd));
}

PyStackFile::~PyStackFile() {
  if (fd_ >= 0) ::close(fd_);
}

bool pythonStacksRegistered(const PyStackFile& file, pid_t pid) {
  int signal = 0;
  long who = 0;
  return readMarker(file.fd(), signal, who) && who == pid && signal == pyStackSignal();
}

std::string pythonStacks(const PyStackFile& file, pid_t pid, std::chrono::milliseconds timeout, std::string& why) {
  if (!pythonStacksRegistered(file, pid)) {
    why = "no Python stacks: the program did not import fsdprun's module";
    return "";
  }
  const char state = processState(pid);
  if (state == 'T' || state == 't') {
    why = "no Python stacks: the process is stopped";
    return "";
  }
  if (state == '?' || state == 'Z' || state == 'X') {
    why = "no Python stacks: the process is gone";
    return "";
  }
  const std::size_t before = sizeOf(file.fd());
  if (::kill(pid, pyStackSignal()) != 0) {
    why = "no Python stacks: signalling pid " + std::to_string(pid) + " failed (errno " + std::to_string(errno) + ")";
    return "";
  }
  // faulthandler writes thread after thread: done when the file has stopped growing a while.
  const auto until = std::chrono::steady_clock::now() + timeout;
  std::size_t seen = before;
  auto grewAt = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(20ms);
    const std::size_t now = sizeOf(file.fd());
    if (now != seen) {
      seen = now;
      grewAt = std::chrono::steady_clock::now();
    } else if (seen > before && std::chrono::steady_clock::now() - grewAt >= 150ms) {
      break;
    }
  }
  if (seen <= before) {
    why = "no Python stacks: nothing written within " + std::to_string(timeout.count()) + " ms";
    return "";
  }
  std::string text(seen - before, '\0');
  const ssize_t n = ::pread(file.fd(), text.data(), text.size(), static_cast<off_t>(before));
  text.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
  return text;
}

std::string withPythonStacks(const WatchedWorker& worker, const std::string& native) {
  if (!worker.pystacks) return native;
  std::string why;
  const std::string python = pythonStacks(*worker.pystacks, worker.pid, 2s, why);
  if (python.empty()) return native;
  return "Python:\n" + python + (python.ends_with('\n') ? "" : "\n") + native;
}

}  // namespace fsdp::launcher::detail
