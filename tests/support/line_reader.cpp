#include "line_reader.hpp"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>

#include "fsdp/common/error.hpp"

namespace fsdp::testing {
namespace {

ChildProcess spawnWithPipe(const std::vector<std::string>& argv, int& readFd) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throwErrno("pipe2", errno);
  SpawnOptions options{.argv = argv, .env = currentEnvironment()};
  options.stdoutFd = fds[1];
  auto child = ChildProcess::spawn(options);
  ::close(fds[1]);
  readFd = fds[0];
  return child;
}

}  // namespace

LineProcess::LineProcess(const std::vector<std::string>& argv) : process_(spawnWithPipe(argv, fd_)) {}

LineProcess::~LineProcess() {
  if (fd_ >= 0) ::close(fd_);
}

std::optional<std::string> LineProcess::readLine(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (const auto nl = buffer_.find('\n'); nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    pollfd pfd{fd_, POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return std::nullopt;
    char buf[4096];
    const ssize_t n = ::read(fd_, buf, sizeof(buf));
    if (n <= 0) return std::nullopt;
    buffer_.append(buf, static_cast<std::size_t>(n));
  }
}

std::optional<std::string> LineProcess::waitFor(const std::string& needle,
                                                std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    const auto line = readLine(std::max(left, std::chrono::milliseconds(0)));
    if (!line) return std::nullopt;
    if (line->find(needle) != std::string::npos) return line;
  }
}

}  // namespace fsdp::testing
