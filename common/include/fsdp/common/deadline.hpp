#pragma once
// A point in time by which an operation must finish. Deadlines are passed down from the
// caller's overall timeout so that nested waits never add up past it.

#include <algorithm>
#include <chrono>

namespace fsdp {

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  static Deadline after(std::chrono::milliseconds timeout) { return Deadline(Clock::now() + timeout); }
  static Deadline never() { return Deadline(Clock::time_point::max()); }

  Clock::time_point when() const noexcept { return when_; }
  bool expired() const { return Clock::now() >= when_; }
  bool isNever() const noexcept { return when_ == Clock::time_point::max(); }

  // Time left, never negative; a large value for never().
  std::chrono::milliseconds remaining() const {
    if (isNever()) return std::chrono::hours(24 * 365);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(when_ - Clock::now());
    return std::max(left, std::chrono::milliseconds(0));
  }

  // The earlier of two deadlines.
  Deadline min(const Deadline& other) const { return when_ <= other.when_ ? *this : other; }

 private:
  explicit Deadline(Clock::time_point when) : when_(when) {}
  Clock::time_point when_;
};

// Milliseconds elapsed since `start`, for messages ("after 1234 ms").
inline long long elapsedMs(Deadline::Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Deadline::Clock::now() - start)
      .count();
}

}  // namespace fsdp
