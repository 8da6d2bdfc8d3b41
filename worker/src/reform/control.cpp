// The worker's end of the agent's control channel (control.hpp).
#include "reform/control.hpp"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"

namespace fsdp::worker::detail {

ReformControl& ReformControl::process() {
  // Never destroyed: its reader thread blocks in recv() for the life of the process.
  static ReformControl* control = new ReformControl();
  return *control;
}

ReformControl::ReformControl() {
  const char* text = std::getenv("FSDPRUN_CONTROL_FD");
  if (text == nullptr || *text == '\0') return;
  char* end = nullptr;
  const long fd = std::strtol(text, &end, 10);
  ::unsetenv("FSDPRUN_CONTROL_FD");
  int type = 0;
  socklen_t length = sizeof(type);
  if (end == text || *end != '\0' || fd < 3 ||
      ::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_TYPE, &type, &length) != 0 || type != SOCK_SEQPACKET) {
    log::warn("FSDPRUN_CONTROL_FD='{}' is not the agent's control socket: no in-process re-formation", text);
    return;
  }
  fd_ = static_cast<int>(fd);
  ::fcntl(fd_, F_SETFD, FD_CLOEXEC);  // the agent's, not for what this program starts
  reader_ = std::thread([this] { readLoop(); });
  reader_.detach();
}

void ReformControl::send(const std::string& text) {
  if (fd_ < 0) return;
  while (::send(fd_, text.data(), text.size(), MSG_NOSIGNAL) < 0 && errno == EINTR) {
  }
}

void ReformControl::announceLocked() {
  const bool now = readyCount_ > 0 && !reforming_;
  if (now == announced_) return;
  announced_ = now;
  send(nlohmann::json{{"ready", now}}.dump());
}

void ReformControl::tellDeviceMemory(bool mayHold) { send(nlohmann::json{{"device_memory", mayHold}}.dump()); }

void ReformControl::setReady(bool ready) {
  if (fd_ < 0) return;
  std::scoped_lock lock(mutex_);
  readyCount_ = std::max(0, readyCount_ + (ready ? 1 : -1));
  announceLocked();
}

void ReformControl::setReforming(bool reforming) {
  if (fd_ < 0) return;
  std::scoped_lock lock(mutex_);
  reforming_ = reforming;
  announceLocked();
}

int ReformControl::addAbortHook(std::function<void(const std::string&)> hook) {
  std::scoped_lock lock(mutex_);
  const int id = nextHook_++;
  hooks_[id] = std::move(hook);
  return id;
}

void ReformControl::removeAbortHook(int id) {
  std::scoped_lock running(hooksRunning_);
  std::scoped_lock lock(mutex_);
  hooks_.erase(id);
}

bool ReformControl::awaitAbort(std::chrono::milliseconds bound) {
  std::unique_lock lock(mutex_);
  changed_.wait_for(lock, bound, [this] { return aborted_ || closed_; });
  return aborted_;
}

std::string ReformControl::abortReason() const {
  std::scoped_lock lock(mutex_);
  return abortReason_;
}

std::optional<std::chrono::steady_clock::time_point> ReformControl::abortTime() const {
  std::scoped_lock lock(mutex_);
  if (!aborted_) return std::nullopt;
  return abortedAt_;
}

std::optional<std::map<std::string, std::string>> ReformControl::awaitReform(std::chrono::milliseconds bound,
                                                                           std::string& why) {
  std::unique_lock lock(mutex_);
  if (!changed_.wait_for(lock, bound, [this] { return reform_.has_value() || closed_; })) {
    why = "no new round from the agent within " + std::to_string(bound.count()) + " ms";
    return std::nullopt;
  }
  if (!reform_) {
    why = "the agent closed the control channel";
    return std::nullopt;
  }
  return reform_;
}

void ReformControl::throwIfAborted(const char* what) const {
  std::scoped_lock lock(mutex_);
  if (aborted_ && !reforming_) {
    throw CommAborted(std::string(what) + ": the round ended, the world re-forms in process (" + abortReason_ + ")");
  }
}

void ReformControl::reformed(int round) {
  if (fd_ < 0) return;
  std::scoped_lock lock(mutex_);
  if (!reforming_) {  // reformDone() outside a re-formation: the agent is told nothing
    log::debug("reformDone() with no re-formation under way: nothing to tell the agent");
    return;
  }
  aborted_ = false;
  abortReason_.clear();
  reform_.reset();
  collectiveFailures_ = 0;
  send(nlohmann::json{{"reformed", {{"round", round}}}}.dump());
  reforming_ = false;
  announceLocked();
}

void ReformControl::readLoop() {
  std::string buffer(64 * 1024, '\0');
  for (;;) {
    const ssize_t n = ::recv(fd_, buffer.data(), buffer.size(), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    const auto message = nlohmann::json::parse(buffer.data(), buffer.data() + n, nullptr, false);
    if (message.is_discarded() || !message.is_object()) {
      log::warn("the agent's control channel: a message that is not a JSON object; ignored");
      continue;
    }
    if (message.contains("abort")) {
      const std::string why = message["abort"].is_string() ? message["abort"].get<std::string>() : "the round ended";
      std::map<int, std::function<void(const std::string&)>> hooks;
      std::scoped_lock running(hooksRunning_);
      {
        std::scoped_lock lock(mutex_);
        aborted_ = true;
        abortReason_ = why;
        abortedAt_ = std::chrono::steady_clock::now();
        hooks = hooks_;
      }
      changed_.notify_all();
      for (const auto& [id, hook] : hooks) {
        try {
          hook(why);
        } catch (const std::exception& e) {
          log::warn("aborting a communicator: {}", e.what());
        }
      }
    } else if (message.contains("reform") && message["reform"].is_object()) {
      std::map<std::string, std::string> env;
      const auto& reform = message["reform"];
      if (const auto it = reform.find("env"); it != reform.end() && it->is_object()) {
        for (const auto& [key, value] : it->items()) {
          if (value.is_string()) env[key] = value.get<std::string>();
        }
      }
      {
        std::scoped_lock lock(mutex_);
        reform_ = std::move(env);
      }
      changed_.notify_all();
    }
  }
  {
    std::scoped_lock lock(mutex_);
    closed_ = true;
  }
  changed_.notify_all();
}

}  // namespace fsdp::worker::detail
