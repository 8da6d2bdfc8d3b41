// fsdp-stamp: the worker of the launcher benchmarks. It appends one line to DIR/<pid>.stamp
// with the CLOCK_MONOTONIC time it started (the clock the benchmark reads too), then acts:
//   true        exit 0
//   sleep S     sleep S seconds, exit 0
//   fail_once   until DIR/failed exists: rank 0 sleeps 0.3 s, creates it, stamps "exit" and
//               exits 1; the other ranks sleep until they are stopped. Afterwards every rank
//               exits 0. (A marker file, not TORCHELASTIC_RESTART_COUNT: torchrun's healthy
//               agents restart their workers with count 0 again.)
// No dependencies beyond libc, so that its own start-up costs nothing measurable.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

namespace {

long long monotonicNs() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<long long>(ts.tv_sec) * 1'000'000'000LL + ts.tv_nsec;
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

void stamp(const std::string& dir, const char* event) {
  const std::string line = std::string(event) + " " + std::to_string(monotonicNs()) +
                           " pid=" + std::to_string(::getpid()) + " rank=" + env("RANK") +
                           " restart=" + env("TORCHELASTIC_RESTART_COUNT") +
                           " world=" + env("WORLD_SIZE") + "\n";
  const std::string path = dir + "/" + std::to_string(::getpid()) + ".stamp";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) std::exit(3);
  if (::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) std::exit(3);
  ::close(fd);
}

void sleepSeconds(double s) {
  timespec ts{static_cast<time_t>(s), static_cast<long>((s - static_cast<time_t>(s)) * 1e9)};
  while (::nanosleep(&ts, &ts) != 0) {
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: fsdp-stamp DIR true|sleep S|fail_once\n");
    return 2;
  }
  const std::string dir = argv[1];
  const std::string mode = argv[2];
  stamp(dir, "start");
  if (mode == "true") return 0;
  if (mode == "sleep" && argc > 3) {
    sleepSeconds(std::atof(argv[3]));
    return 0;
  }
  if (mode == "fail_once") {
    const std::string marker = dir + "/failed";
    if (::access(marker.c_str(), F_OK) == 0) return 0;
    if (env("RANK") == "0") {
      sleepSeconds(0.3);
      const int fd = ::open(marker.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
      if (fd >= 0) ::close(fd);
      stamp(dir, "exit");
      return 1;
    }
    sleepSeconds(600);
    return 0;
  }
  std::fprintf(stderr, "fsdp-stamp: unknown mode %s\n", mode.c_str());
  return 2;
}
