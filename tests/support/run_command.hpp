#pragma once
// Test helper: runs a command to completion under a time limit, capturing its output.

#include <chrono>
#include <string>
#include <vector>

namespace fsdp::testing {

struct RunResult {
  bool timedOut = false;
  int exitCode = -1;  // -1 when killed by a signal
  int signal = 0;
  std::string out;
  std::string err;
  int pid = -1;
};

// Starts argv (extraEnv entries "K=V" replacing or added to the current environment), waits at most
// `timeout`; on timeout kills the process group and reports timedOut.
RunResult runCommand(const std::vector<std::string>& argv, std::chrono::milliseconds timeout,
                     const std::vector<std::string>& extraEnv = {});

// A fresh temporary directory, removed by the destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string readFile(const std::string& path);

// Debian's python3, the one python3-torch installs into (a pyenv or venv first on PATH may have
// no torch), and whether it can import torch.distributed: the PyTorch tests skip without it.
inline constexpr const char* kSystemPython = "/usr/bin/python3";
bool systemPythonHasTorch();

// Number of non-overlapping occurrences of `needle` in `text`.
int countOccurrences(const std::string& text, const std::string& needle);

}  // namespace fsdp::testing
