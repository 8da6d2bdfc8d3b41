#pragma once
// The agent's small OS helpers: its signalfd, its scratch directory, the job token file, and
// the wall-clock time stamps of failure reports. Private to the launcher.
//
// Thread-safety: none; the agent's thread owns these objects.

#include <signal.h>

#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::launcher::detail {

// Owns the signalfd and the blocked mask of the signals the agent handles.
class SignalFd {
 public:
  explicit SignalFd(const std::vector<int>& handled);
  ~SignalFd();
  SignalFd(const SignalFd&) = delete;
  SignalFd& operator=(const SignalFd&) = delete;

  int fd() const { return fd_; }
  // The signals that arrived (without waiting).
  std::vector<int> take();

 private:
  sigset_t mask_{};
  sigset_t previous_{};
  int fd_ = -1;
};

// A private directory, removed with the object.
class ScratchDir {
 public:
  ScratchDir();
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Writes a fresh job token into `dir`/token, readable by this user only. Workers get the path
// (FSDPRUN_TOKEN_FILE), never the token in their environment or command line.
std::string writeToken(const std::string& dir, const std::string& token);

// The token on the first line of `path`; throws ConfigError naming `where` when it cannot.
std::string readToken(const std::string& path, const std::string& where);

// A new agent id: 16 random hex digits, unique to this agent process among the run's agents.
std::string newAgentId();

// The current wall-clock time, ISO 8601 (UTC).
std::string utcNow();

// An error file in torchrun's shape (what its @record writes, what its launcher copies):
// {"message": {"message", "extraInfo": {<extraInfo>..., "timestamp": "<now>"}, "errorCode"?}}.
nlohmann::json torchrunError(const std::string& message, nlohmann::json extraInfo, long long now,
                             std::optional<int> errorCode = std::nullopt);

}  // namespace fsdp::launcher::detail
