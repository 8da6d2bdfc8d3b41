#pragma once
// Stragglers named from every rank's step split over a window of steps: fast ranks wait for slow
// ones, so the rank whose compute stands out is the slow one. Pure, shared by libfsdp's monitor
// (rank 0 judges libfsdp ranks, worker/src/stats/straggler.hpp) and the agent (which judges the
// ranks of PyTorch scripts from their flight rings, launcher/src/metrics/python_stragglers.hpp).
//
//   FSDPRUN_STRAGGLER_EVERY   steps per report (default 20; 0: off)
//   FSDPRUN_STRAGGLER_FACTOR  times the median compute that names a rank (default 1.5; > 1)

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp::stragglers {

struct Options {
  int every = 20;
  double factor = 1.5;
  double minGapMs = 1.0;
};

// From FSDPRUN_STRAGGLER_EVERY / FSDPRUN_STRAGGLER_FACTOR; ConfigError naming the variable, the
// value and what was expected.
Options optionsFromEnv();

// One rank's means over a window of steps.
struct WindowFigures {
  double computeMs = 0, waitMs = 0, dataMs = 0;
  std::string node;
};

struct Event {
  bool recovered = false;  // false: named as a straggler in this report
  int rank = 0;
  std::string node;
  double factor = 0;       // compute / the median of the other ranks' (medianComputeMs)
  double computeMs = 0, medianComputeMs = 0, waitMs = 0, dataMs = 0;
  std::int64_t firstStep = 0, lastStep = 0;
  std::string line() const;  // "straggler: rank 5 (node3) 1.9x the median compute (...)"
};

// What one window of every rank's figures says, given the ranks named before (updated): each
// rank against the median of the others (with two ranks, the other one), named at `factor` times
// it and at least minGapMs a step more, recovered once back under the midpoint (1.25x for 1.5x).
struct WindowVerdict {
  double medianComputeMs = 0;
  std::vector<double> factors;  // per rank
  std::vector<Event> events;
};
WindowVerdict judgeWindow(const std::vector<WindowFigures>& ranks, const Options& options,
                          std::map<int, bool>& named, std::int64_t firstStep, std::int64_t lastStep);

}  // namespace fsdp::stragglers
