// The step split (compute, waiting in collectives, waiting for data) the flight recorder keeps
// per step, and the straggler verdicts rank 0 draws from every rank's split: the verdicts over
// generated windows (seeded; a failure prints its seed), the split over real time.
#include <gtest/gtest.h>

#include <ATen/Functions.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "comm/recorded_communicator.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/worker/flight_recorder.hpp"
#include "stats/straggler.hpp"

namespace {

using namespace fsdp::worker;
using fsdp::worker::detail::FlightRecorder;
using fsdp::worker::detail::judgeWindow;
using fsdp::worker::detail::StragglerOptions;
using fsdp::worker::detail::WindowFigures;

// Spins until `ms` milliseconds of wall time passed (the split measures wall time).
void spend(double ms) {
  const auto until = fsdp::flight::nowNs() + static_cast<std::int64_t>(ms * 1e6);
  while (fsdp::flight::nowNs() < until) {
  }
}

fsdp::flight::StepTiming timing() { return FlightRecorder::process().read(0).timing; }

TEST(StepTiming, AStepIsSplitIntoCollectiveWaitDataAndComputeAndOverlapsCountOnce) {
  auto& recorder = FlightRecorder::process();
  ASSERT_TRUE(recorder.timing());
  markProgress(100);
  const auto before = timing();
  // Two collectives of two groups in flight together for 20 ms: 20 ms of waiting, not 40.
  const auto a = recorder.issue({.group = "a", .op = fsdp::flight::Op::kAllGather}, true);
  spend(5);
  const auto b = recorder.issue({.group = "b", .op = fsdp::flight::Op::kAllReduce}, true);
  spend(15);
  recorder.complete(a, true);
  recorder.complete(b, true);
  recorder.complete(b, true);  // told twice (the watcher and the caller's wait): counted once
  {
    const DataWait data;
    spend(10);
  }
  spend(8);  // compute
  reportStep(32, 0, 0.5);
  markProgress(101);
  const auto t = timing();
  EXPECT_EQ(t.steps, before.steps + 1);
  EXPECT_GE(t.lastWaitNs, 20'000'000);
  EXPECT_LT(t.lastWaitNs, 30'000'000 + (t.lastStepNs - 38'000'000));  // not doubled by the overlap
  EXPECT_GE(t.lastDataNs, 10'000'000);
  EXPECT_GE(t.lastStepNs, 38'000'000);
  EXPECT_GE(t.lastComputeNs(), 8'000'000);
  EXPECT_EQ(t.lastStepNs, t.lastWaitNs + t.lastDataNs + t.lastComputeNs());
  EXPECT_EQ(t.lastSamples, 32);
  EXPECT_DOUBLE_EQ(t.loss, 0.5);
  EXPECT_EQ(t.stepNs - before.stepNs, t.lastStepNs);
}

TEST(StepTiming, ACollectiveInFlightAtTheMarkIsSplitBetweenTheTwoSteps) {
  auto& recorder = FlightRecorder::process();
  markProgress(200);
  const auto c = recorder.issue({.group = "a", .op = fsdp::flight::Op::kAllReduce}, false);
  recorder.start(c);
  spend(10);
  markProgress(201);
  const auto first = timing();
  spend(10);
  recorder.complete(c, true);
  markProgress(202);
  const auto second = timing();
  EXPECT_GE(first.lastWaitNs, 10'000'000);
  EXPECT_GE(second.lastWaitNs, 10'000'000);
  EXPECT_LE(second.lastWaitNs, second.lastStepNs);
}

TEST(StepTiming, AnActivityMarkOrTheSameStepMarkedAgainIsNoStep) {
  markProgress(300);
  const auto before = timing();
  markProgress(-1, "eval batch");
  markProgress(300, "snapshot step");  // Snapshotter::save after the Trainer's mark
  EXPECT_EQ(timing().steps, before.steps);
  markProgress(301);
  EXPECT_EQ(timing().steps, before.steps + 1);
}

// Generated windows: every rank's compute is a base with up to 10% noise; the chosen ranks are
// slowed by a factor from 1.6 to 4. Exactly those are named; nobody is named at a factor of 1.2;
// a named rank back at the base is reported recovered, once.
TEST(Stragglers, GeneratedWindowsNameExactlyTheSlowedRanksAndReportTheirRecovery) {
  const StragglerOptions options{.every = 20, .factor = 1.5, .minGapMs = 1.0};
  for (std::uint32_t seed = 1; seed <= 200; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    const int world = std::uniform_int_distribution<int>(2, 64)(rng);
    const double base = std::uniform_real_distribution<double>(5, 500)(rng);
    std::uniform_real_distribution<double> noise(0.95, 1.05);
    // At most a third of the ranks slowed (and one of two): the median stays a fast rank's.
    const int slowCount = std::uniform_int_distribution<int>(1, std::max(1, (world - 1) / 3))(rng);
    std::vector<int> order(static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) order[static_cast<std::size_t>(r)] = r;
    std::shuffle(order.begin(), order.end(), rng);
    std::map<int, double> slowed;
    for (int i = 0; i < slowCount; ++i) slowed[order[static_cast<std::size_t>(i)]] = std::uniform_real_distribution<double>(1.6, 4)(rng);

    const auto window = [&](bool slow, double mildFactor) {
      std::vector<WindowFigures> ranks;
      for (int r = 0; r < world; ++r) {
        double compute = base * noise(rng);
        if (slow && slowed.count(r)) compute = base * slowed[r];
        if (!slow && mildFactor > 0 && r == order[0]) compute = base * mildFactor;
        ranks.push_back({.computeMs = compute, .waitMs = base * 0.3, .dataMs = 0.1, .node = "node" + std::to_string(r / 4)});
      }
      return ranks;
    };
    std::map<int, bool> named;
    // A mild slowdown (1.2x) names nobody.
    auto verdict = judgeWindow(window(false, 1.2), options, named, 1, 20);
    EXPECT_TRUE(verdict.events.empty());
    verdict = judgeWindow(window(true, 0), options, named, 21, 40);
    std::map<int, double> seen;
    for (const auto& e : verdict.events) {
      EXPECT_FALSE(e.recovered);
      seen[e.rank] = e.factor;
      EXPECT_NE(e.line().find("straggler: rank " + std::to_string(e.rank) + " (node" + std::to_string(e.rank / 4) + ")"),
                std::string::npos)
          << e.line();
    }
    ASSERT_EQ(seen.size(), slowed.size());
    for (const auto& [rank, factor] : slowed) {
      ASSERT_TRUE(seen.count(rank)) << "rank " << rank << " slowed " << factor << "x was not named";
      EXPECT_NEAR(seen[rank], factor, factor * 0.08);
    }
    ASSERT_EQ(verdict.factors.size(), static_cast<std::size_t>(world));
    // Still slow: named again in the next report.
    verdict = judgeWindow(window(true, 0), options, named, 41, 60);
    EXPECT_EQ(verdict.events.size(), slowed.size());
    // Back to normal: each reported recovered once, then nothing.
    verdict = judgeWindow(window(false, 0), options, named, 61, 80);
    EXPECT_EQ(verdict.events.size(), slowed.size());
    for (const auto& e : verdict.events) {
      EXPECT_TRUE(e.recovered);
      EXPECT_TRUE(slowed.count(e.rank));
      EXPECT_NE(e.line().find("straggler recovered: rank"), std::string::npos);
    }
    verdict = judgeWindow(window(false, 0), options, named, 81, 100);
    EXPECT_TRUE(verdict.events.empty());
  }
}

TEST(Stragglers, TinyStepsBelowTheNoiseFloorNameNobody) {
  std::map<int, bool> named;
  // 0.1 ms against 0.3 ms is 3x, but a fifth of a millisecond a step is noise.
  const auto verdict = judgeWindow({{.computeMs = 0.1}, {.computeMs = 0.1}, {.computeMs = 0.3}}, {}, named, 1, 20);
  EXPECT_TRUE(verdict.events.empty());
}

TEST(Stragglers, BadSettingsAreRefusedNamingTheVariable) {
  ::setenv("FSDPRUN_STRAGGLER_FACTOR", "0.9", 1);
  try {
    fsdp::worker::detail::stragglerOptionsFromEnv();
    FAIL() << "a factor of 0.9 was accepted";
  } catch (const fsdp::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("FSDPRUN_STRAGGLER_FACTOR '0.9'"), std::string::npos) << e.what();
  }
  ::setenv("FSDPRUN_STRAGGLER_FACTOR", "2", 1);
  ::setenv("FSDPRUN_STRAGGLER_EVERY", "ten", 1);
  EXPECT_THROW(fsdp::worker::detail::stragglerOptionsFromEnv(), fsdp::ConfigError);
  ::setenv("FSDPRUN_STRAGGLER_EVERY", "10", 1);
  const auto o = fsdp::worker::detail::stragglerOptionsFromEnv();
  EXPECT_EQ(o.every, 10);
  EXPECT_DOUBLE_EQ(o.factor, 2);
  ::unsetenv("FSDPRUN_STRAGGLER_EVERY");
  ::unsetenv("FSDPRUN_STRAGGLER_FACTOR");
}

}  // namespace
