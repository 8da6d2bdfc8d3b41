#pragma once
// What the Slurm system tests share: the paths of the binaries and sources, a few text helpers,
// and BatchJob, a job submitted with `sbatch --wait` (the sbatch process lives as long as the
// job; scancelled by the destructor if still running).

#include <sys/wait.h>

#include <chrono>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp/common/env.hpp"
#include "line_reader.hpp"
#include "processes.hpp"
#include "run_command.hpp"

namespace fsdp::testing {

using namespace std::chrono_literals;

inline std::string binPath(const std::string& name) { return std::string(FSDP_BIN_DIR) + "/" + name; }
inline std::string sourcePath(const std::string& rel) { return std::string(FSDP_SOURCE_DIR) + "/" + rel; }

inline double secondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

inline std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// Live processes whose environment has SLURM_JOB_ID=<jobId>, anywhere on the machine.
inline std::vector<pid_t> jobProcesses(long long jobId) {
  const auto pids = processesWithEnvironment("SLURM_JOB_ID=" + std::to_string(jobId));
  return std::vector<pid_t>(pids.begin(), pids.end());
}

inline bool hasLine(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

// A batch job submitted with `sbatch --wait`: the sbatch process lives as long as the job.
class BatchJob {
 public:
  // Submits `script` (with `args` after it) with the sbatch options `options`; its output goes
  // to `output`. Throws when sbatch prints no job id within 30 s.
  BatchJob(const std::vector<std::string>& options, const std::string& script,
           const std::vector<std::string>& args, std::string output)
      : output_(std::move(output)) {
    // stdbuf: sbatch prints the id at submission, but stdio would keep it until exit.
    std::vector<std::string> argv = {"stdbuf",     "-oL",    "sbatch",
                                     "--parsable", "--wait", "--output=" + output_};
    argv.insert(argv.end(), options.begin(), options.end());
    argv.push_back(script);
    argv.insert(argv.end(), args.begin(), args.end());
    sbatch_ = std::make_unique<LineProcess>(argv);
    const auto line = sbatch_->readLine(30s);
    const auto id = line ? parseInt(line->substr(0, line->find(';'))) : std::nullopt;
    if (!id) throw std::runtime_error("sbatch printed no job id: " + line.value_or("<nothing>"));
    id_ = *id;
  }
  ~BatchJob() {
    if (!sbatch_->process().reaped()) {
      runCommand({"scancel", std::to_string(id_)}, 30s);
      sbatch_->process().waitFor(30s);
    }
  }
  long long id() const { return id_; }
  const std::string& output() const { return output_; }
  // The job's exit code (sbatch --wait exits with it), or nullopt when it did not end in time.
  std::optional<int> wait(std::chrono::milliseconds timeout) {
    const auto status = sbatch_->process().waitFor(timeout);
    if (!status || !WIFEXITED(*status)) return std::nullopt;
    return WEXITSTATUS(*status);
  }

 private:
  std::string output_;
  std::unique_ptr<LineProcess> sbatch_;
  long long id_ = 0;
};

}  // namespace fsdp::testing
