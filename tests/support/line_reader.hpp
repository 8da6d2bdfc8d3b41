#pragma once
// Test helper: a child process whose stdout is read line by line with a bounded wait.

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/common/process.hpp"

namespace fsdp::testing {

class LineProcess {
 public:
  explicit LineProcess(const std::vector<std::string>& argv);
  ~LineProcess();
  LineProcess(const LineProcess&) = delete;
  LineProcess& operator=(const LineProcess&) = delete;
  // The next line, or nullopt when none arrives within `timeout` (or stdout closed).
  std::optional<std::string> readLine(std::chrono::milliseconds timeout);
  // Reads lines until one contains `needle`; returns it, or nullopt after `timeout`.
  std::optional<std::string> waitFor(const std::string& needle, std::chrono::milliseconds timeout);
  ChildProcess& process() { return process_; }

 private:
  int fd_ = -1;            // before process_: the constructor fills it while spawning
  ChildProcess process_;
  std::string buffer_;
};

}  // namespace fsdp::testing
