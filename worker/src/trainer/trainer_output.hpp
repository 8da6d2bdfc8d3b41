#pragma once
// What the Trainer shows and hears besides training (trainer.cpp): the progress line's clock and
// rate texts, whole lines on stdout, the metrics lines' clock, and the checkpoint signal.
// Private to libfsdp.

#include <signal.h>

#include <string>

namespace fsdp::worker::detail {

// "MM:SS" or "H:MM:SS"; "--:--" for what is not a time.
std::string clock(double seconds);
// A rate with a unit prefix: 1730 -> "1730", 45210 -> "45.2k".
std::string rate(double v);
// Seconds since the epoch: metrics lines of different processes (a restart) on one clock.
double unixTime();
// One whole line on stdout in one write (ranks share the console).
void emitLine(const std::string& text);

// Installs the checkpoint signal's handler for the run when the signal is at its default;
// restores it afterwards.
class CheckpointSignal {
 public:
  explicit CheckpointSignal(int sig);
  ~CheckpointSignal();
  CheckpointSignal(const CheckpointSignal&) = delete;
  CheckpointSignal& operator=(const CheckpointSignal&) = delete;
  bool installed() const { return installed_; }

 private:
  int sig_;
  bool installed_ = false;
  struct sigaction previous_ {};
};
// Whether the signal came since the last call (and forgets it).
bool takeCheckpointRequest();

}  // namespace fsdp::worker::detail
