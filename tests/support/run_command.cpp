#include "run_command.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"

namespace fsdp::testing {

bool systemPythonHasTorch() {
  using namespace std::chrono_literals;
  static const bool has =
      ::access(kSystemPython, X_OK) == 0 &&
      runCommand({kSystemPython, "-c", "import torch.distributed"}, 60s).exitCode == 0;
  return has;
}

TempDir::TempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "fsdp-test-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) throwErrno("mkdtemp", errno);
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int countOccurrences(const std::string& text, const std::string& needle) {
  int count = 0;
  for (auto pos = text.find(needle); pos != std::string::npos;
       pos = text.find(needle, pos + needle.size())) {
    ++count;
  }
  return count;
}

RunResult runCommand(const std::vector<std::string>& argv, std::chrono::milliseconds timeout,
                     const std::vector<std::string>& extraEnv) {
  TempDir dir;
  SpawnOptions options{.argv = argv, .env = currentEnvironment()};
  for (const auto& entry : extraEnv) {  // an extra entry replaces the inherited one of its name
    const std::string key = entry.substr(0, entry.find('=') + 1);
    std::erase_if(options.env, [&](const std::string& e) { return e.starts_with(key); });
    options.env.push_back(entry);
  }
  options.stdoutPath = dir.path() + "/stdout";
  options.stderrPath = dir.path() + "/stderr";
  auto child = ChildProcess::spawn(options);
  RunResult result;
  result.pid = child.pid();
  auto status = child.waitFor(timeout);
  if (!status) {
    result.timedOut = true;
    child.signal(SIGKILL);
    status = child.waitFor(std::chrono::seconds(10));
  }
  if (status && WIFEXITED(*status)) result.exitCode = WEXITSTATUS(*status);
  if (status && WIFSIGNALED(*status)) result.signal = WTERMSIG(*status);
  result.out = readFile(*options.stdoutPath);
  result.err = readFile(*options.stderrPath);
  return result;
}

}  // namespace fsdp::testing
