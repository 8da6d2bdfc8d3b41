#include "fsdp/common/lifeline.hpp"

#include <linux/futex.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "fsdp/common/error.hpp"

namespace fsdp {
namespace {

constexpr std::size_t kPageBytes = 4096;

// The robust mutex's futex word: the owner's thread id, FUTEX_WAITERS and FUTEX_OWNER_DIED, as
// the kernel's robust-list protocol defines it. glibc keeps it first in pthread_mutex_t.
static_assert(offsetof(pthread_mutex_t, __data.__lock) == 0);
static_assert(sizeof(pthread_mutex_t) <= kPageBytes);

unsigned* wordOf(void* page) { return static_cast<unsigned*>(page); }

long futex(unsigned* word, int op, unsigned value) {
  // Shared (no FUTEX_PRIVATE_FLAG): the worker's mapping and the agent's are of one memfd.
  return ::syscall(SYS_futex, word, op, value, nullptr, nullptr, 0);
}

}  // namespace

void holdLifeline() {
  const char* text = std::getenv("FSDPRUN_LIFELINE_FD");
  if (text == nullptr) return;
  const int fd = std::atoi(text);
  ::unsetenv("FSDPRUN_LIFELINE_FD");
  if (fd < 0) return;
  // Only the main thread lives as long as the process: a lifeline held by another thread
  // would be released while the worker goes on.
  if (::gettid() != ::getpid()) {
    ::close(fd);
    return;
  }
  void* page = ::mmap(nullptr, kPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (page == MAP_FAILED) return;
  auto* mutex = static_cast<pthread_mutex_t*>(page);
  // trylock: a second holder (a child forked before init() that inherited the variable) gets
  // EBUSY and goes on without one; it must never block here.
  if (::pthread_mutex_trylock(mutex) != 0) {
    ::munmap(page, kPageBytes);
    return;
  }
  // The agent's watcher may be waiting for the lifeline to be taken. The page stays mapped
  // for the life of the process: the kernel reaches the mutex through it at exit.
  futex(wordOf(page), FUTEX_WAKE, INT_MAX);
}

LifelineWatch::LifelineWatch(int notifyFd, unsigned char token) : notifyFd_(notifyFd), token_(token) {
  fd_ = ::memfd_create("fsdprun-lifeline", MFD_CLOEXEC);
  if (fd_ < 0) throwErrno("memfd_create for a worker's lifeline", errno);
  if (::ftruncate(fd_, kPageBytes) != 0) {
    const int e = errno;
    ::close(fd_);
    throwErrno("sizing a worker's lifeline", e);
  }
  page_ = ::mmap(nullptr, kPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (page_ == MAP_FAILED) {
    const int e = errno;
    ::close(fd_);
    throwErrno("mapping a worker's lifeline", e);
  }
  pthread_mutexattr_t attr;
  ::pthread_mutexattr_init(&attr);
  ::pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  ::pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  ::pthread_mutex_init(static_cast<pthread_mutex_t*>(page_), &attr);
  ::pthread_mutexattr_destroy(&attr);
  thread_ = std::thread([this] { watch(); });
}

LifelineWatch::~LifelineWatch() {
  // The worker is gone by now (its group reaps it first). Marking the word changes what a
  // watcher about to sleep expects, so that it cannot miss the wake.
  stop_.store(true);
  __atomic_fetch_or(wordOf(page_), FUTEX_OWNER_DIED, __ATOMIC_SEQ_CST);
  futex(wordOf(page_), FUTEX_WAKE, INT_MAX);
  thread_.join();
  ::munmap(page_, kPageBytes);
  ::close(fd_);
}

void LifelineWatch::watch() {
  unsigned* word = wordOf(page_);
  for (;;) {
    if (stop_.load()) return;
    unsigned value = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    if ((value & FUTEX_OWNER_DIED) != 0) {
      if (!stop_.load()) {
        while (::write(notifyFd_, &token_, 1) < 0 && errno == EINTR) {
        }
      }
      return;
    }
    if ((value & FUTEX_TID_MASK) != 0 && (value & FUTEX_WAITERS) == 0) {
      // Held: ask the kernel to wake a waiter when it releases it for a dead owner.
      const unsigned waiting = value | FUTEX_WAITERS;
      if (!__atomic_compare_exchange_n(word, &value, waiting, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
      value = waiting;
    }
    // Until the word changes: taken (the holder wakes us), released by the kernel, or stopped.
    futex(word, FUTEX_WAIT, value);
  }
}

std::optional<int> exitingStatus(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!in || !std::getline(in, text)) return std::nullopt;
  // "pid (comm) state ppid ...": comm may hold anything, so fields count from its last ')'.
  const auto close = text.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream fields(text.substr(close + 1));
  std::string field;
  unsigned long flags = 0;
  constexpr unsigned long kPfExiting = 0x4;  // include/linux/sched.h
  try {
    for (int n = 3; fields >> field; ++n) {
      if (n == 9) flags = std::stoul(field);
      if (n == 52) {  // exit_code, as waitpid reports it (Linux 3.5+)
        if ((flags & kPfExiting) == 0) return std::nullopt;
        return std::stoi(field);
      }
    }
  } catch (const std::exception&) {  // a field that is not a number: /proc cannot say
  }
  return std::nullopt;
}

}  // namespace fsdp
