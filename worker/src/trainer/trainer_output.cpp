// The Trainer's output helpers and checkpoint signal (trainer_output.hpp).
#include "trainer/trainer_output.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>

namespace fsdp::worker::detail {
namespace {

// Set by the checkpoint signal's handler. A signal handler can only reach a global; a lock-free
// atomic is async-signal-safe.
std::atomic<bool> gCheckpointRequested{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void onCheckpointSignal(int) { gCheckpointRequested.store(true); }

}  // namespace

std::string clock(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--";
  const auto s = static_cast<long long>(seconds + 0.5);
  char text[32];
  if (s >= 3600) {
    std::snprintf(text, sizeof(text), "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  } else {
    std::snprintf(text, sizeof(text), "%02lld:%02lld", s / 60, s % 60);
  }
  return text;
}

std::string rate(double v) {
  char text[32];
  if (v >= 1e6) {
    std::snprintf(text, sizeof(text), "%.2fM", v / 1e6);
  } else if (v >= 1e4) {
    std::snprintf(text, sizeof(text), "%.1fk", v / 1e3);
  } else {
    std::snprintf(text, sizeof(text), "%.0f", v);
  }
  return text;
}

double unixTime() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void emitLine(const std::string& text) {
  const std::string line = text + "\n";
  [[maybe_unused]] const auto n = ::write(STDOUT_FILENO, line.data(), line.size());
}

CheckpointSignal::CheckpointSignal(int sig) : sig_(sig) {
  if (sig_ <= 0) return;
  struct sigaction current {};
  if (::sigaction(sig_, nullptr, &current) != 0 || current.sa_handler != SIG_DFL) return;
  struct sigaction handler {};
  handler.sa_handler = onCheckpointSignal;
  handler.sa_flags = SA_RESTART;
  sigemptyset(&handler.sa_mask);
  installed_ = ::sigaction(sig_, &handler, &previous_) == 0;
  gCheckpointRequested.store(false);
}

CheckpointSignal::~CheckpointSignal() {
  if (installed_) ::sigaction(sig_, &previous_, nullptr);
}

bool takeCheckpointRequest() { return gCheckpointRequested.exchange(false); }

}  // namespace fsdp::worker::detail
