#pragma once
// Test helper: a real fsdprun-rdzv process on a free loopback port, killed by the destructor.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/common/process.hpp"

namespace fsdp::testing {

class RdzvDaemon {
 public:
  // Starts build/bin/fsdprun-rdzv --port 0 plus `args` (behind `wrapper`, a command that
  // execs the rest, e.g. prlimit, when given), and reads the port it prints.
  // Its stderr (the log) goes to `stderrPath` when given, else to the test's.
  explicit RdzvDaemon(const std::vector<std::string>& args = {},
                      const std::vector<std::string>& wrapper = {},
                      const std::string& stderrPath = {});
  std::uint16_t port() const { return port_; }
  ChildProcess& process() { return *process_; }

 private:
  std::optional<ChildProcess> process_;
  std::uint16_t port_ = 0;
};

}  // namespace fsdp::testing
