// The agent's small OS helpers: signalfd, scratch directory, job token file, UTC time stamps.
#include "agent_support.hpp"

#include <fcntl.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "fsdp/common/error.hpp"

namespace fsdp::launcher::detail {

SignalFd::SignalFd(const std::vector<int>& handled) {
  sigemptyset(&mask_);
  sigaddset(&mask_, SIGCHLD);
  for (int sig : handled) sigaddset(&mask_, sig);
  if (::sigprocmask(SIG_BLOCK, &mask_, &previous_) != 0) throwErrno("sigprocmask", errno);
  fd_ = ::signalfd(-1, &mask_, SFD_CLOEXEC | SFD_NONBLOCK);
  if (fd_ < 0) throwErrno("signalfd", errno);
}

SignalFd::~SignalFd() {
  ::close(fd_);
  ::sigprocmask(SIG_SETMASK, &previous_, nullptr);
}

std::vector<int> SignalFd::take() {
  std::vector<int> out;
  signalfd_siginfo info{};
  while (::read(fd_, &info, sizeof(info)) == sizeof(info)) {
    out.push_back(static_cast<int>(info.ssi_signo));
  }
  return out;
}

ScratchDir::ScratchDir() {
  std::string dir = (std::filesystem::temp_directory_path() / "fsdprun-XXXXXX").string();
  if (::mkdtemp(dir.data()) == nullptr) throwErrno("mkdtemp", errno);
  path_ = dir;
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string writeToken(const std::string& dir, const std::string& token) {
  const std::string path = dir + "/token";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throwErrno("creating " + path, errno);
  const bool ok = ::write(fd, token.data(), token.size()) == static_cast<ssize_t>(token.size());
  ::close(fd);
  if (!ok) throwErrno("writing " + path, errno);
  return path;
}

std::string readToken(const std::string& path, const std::string& where) {
  std::ifstream in(path);
  std::string token;
  if (!in || !std::getline(in, token) || token.empty()) {
    throw ConfigError(where + " '" + path + "': cannot read a job token from it");
  }
  return token;
}

std::string utcNow() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char text[32] = {};
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

nlohmann::json torchrunError(const std::string& message, nlohmann::json extraInfo, long long now,
                             std::optional<int> errorCode) {
  extraInfo["timestamp"] = std::to_string(now);
  nlohmann::json inner{{"message", message}, {"extraInfo", std::move(extraInfo)}};
  if (errorCode) inner["errorCode"] = *errorCode;
  return nlohmann::json{{"message", std::move(inner)}};
}

std::string newAgentId() {
  std::random_device random;
  const std::uint64_t id = (std::uint64_t{random()} << 32) ^ random();
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(id));
  return text;
}

}  // namespace fsdp::launcher::detail
