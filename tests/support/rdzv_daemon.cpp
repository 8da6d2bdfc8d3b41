#include "rdzv_daemon.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "fsdp/common/error.hpp"

namespace fsdp::testing {

RdzvDaemon::RdzvDaemon(const std::vector<std::string>& args, const std::vector<std::string>& wrapper,
                       const std::string& stderrPath) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throwErrno("pipe2", errno);
  SpawnOptions options{.argv = wrapper, .env = currentEnvironment()};
  options.argv.insert(options.argv.end(), {std::string(FSDP_BIN_DIR) + "/fsdprun-rdzv", "--port", "0"});
  options.argv.insert(options.argv.end(), args.begin(), args.end());
  options.stdoutFd = fds[1];
  if (!stderrPath.empty()) options.stderrPath = stderrPath;
  process_.emplace(ChildProcess::spawn(options));
  ::close(fds[1]);
  // Read "fsdprun-rdzv: listening on HOST:PORT ..." within 10 s.
  const std::string line = readLineWithin(fds[0], std::chrono::seconds(10));
  ::close(fds[0]);
  const auto colon = line.rfind(':', line.find(" ("));
  if (line.find("listening on") == std::string::npos || colon == std::string::npos) {
    throw Error("fsdprun-rdzv did not report its port; it printed: '" + line + "'");
  }
  port_ = static_cast<std::uint16_t>(std::stoi(line.substr(colon + 1)));
}

}  // namespace fsdp::testing
