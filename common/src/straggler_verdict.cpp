// Stragglers judged from a window of every rank's step split (straggler_verdict.hpp).
#include "fsdp/common/straggler_verdict.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "fsdp/common/error.hpp"

namespace fsdp::stragglers {
namespace {

std::string fixed(double value, int digits) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.*f", digits, value);
  return text;
}

// "12", "3.4", "0.25": milliseconds as a person reads them.
std::string ms(double value) { return fixed(value, value >= 10 ? 0 : (value >= 1 ? 1 : 2)); }

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

}  // namespace

Options optionsFromEnv() {
  Options o;
  if (const char* text = std::getenv("FSDPRUN_STRAGGLER_EVERY")) {
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    if (*text == '\0' || *end != '\0' || value < 0 || value > 1000000) {
      throw ConfigError(std::string("FSDPRUN_STRAGGLER_EVERY '") + text +
                        "': expected a number of steps between stragglers reports (0: off)");
    }
    o.every = static_cast<int>(value);
  }
  if (const char* text = std::getenv("FSDPRUN_STRAGGLER_FACTOR")) {
    char* end = nullptr;
    const double value = std::strtod(text, &end);
    if (*text == '\0' || *end != '\0' || !(value > 1.0) || !std::isfinite(value)) {
      throw ConfigError(std::string("FSDPRUN_STRAGGLER_FACTOR '") + text +
                        "': expected a factor above 1 (a rank is named at this many times the median compute)");
    }
    o.factor = value;
  }
  return o;
}

std::string Event::line() const {
  std::string text = recovered ? "straggler recovered: rank " : "straggler: rank ";
  text += std::to_string(rank) + " (" + node + ") " + fixed(factor, 1) + "x the median compute (" +
          ms(computeMs) + " vs " + ms(medianComputeMs) + " ms per step";
  if (!recovered) text += "; waits " + ms(waitMs) + " ms in collectives, " + ms(dataMs) + " ms for data";
  text += ", steps " + std::to_string(firstStep) + "-" + std::to_string(lastStep) + ")";
  return text;
}

WindowVerdict judgeWindow(const std::vector<WindowFigures>& ranks, const Options& options,
                          std::map<int, bool>& named, std::int64_t firstStep, std::int64_t lastStep) {
  WindowVerdict v;
  std::vector<double> compute;
  compute.reserve(ranks.size());
  for (const auto& r : ranks) compute.push_back(r.computeMs);
  v.medianComputeMs = median(compute);
  // Each rank against the median of the others: with two ranks, the other one.
  std::vector<double> sorted = compute;
  std::sort(sorted.begin(), sorted.end());
  const auto othersMedian = [&](double value) {
    if (sorted.size() < 2) return value;
    const auto skip = static_cast<std::size_t>(std::lower_bound(sorted.begin(), sorted.end(), value) - sorted.begin());
    const std::size_t n = sorted.size() - 1;
    const auto at = [&](std::size_t p) { return sorted[p < skip ? p : p + 1]; };
    return n % 2 == 1 ? at(n / 2) : (at(n / 2 - 1) + at(n / 2)) / 2;
  };
  const double recoverBelow = 1.0 + (options.factor - 1.0) / 2;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const auto& r = ranks[i];
    const double others = othersMedian(r.computeMs);
    const double factor = others > 0 ? r.computeMs / others : 1.0;
    v.factors.push_back(factor);
    const int rank = static_cast<int>(i);
    const bool slow = factor >= options.factor && r.computeMs - others >= options.minGapMs;
    const bool wasNamed = named.count(rank) > 0 && named[rank];
    Event e{.recovered = false, .rank = rank, .node = r.node, .factor = factor,
                     .computeMs = r.computeMs, .medianComputeMs = others, .waitMs = r.waitMs,
                     .dataMs = r.dataMs, .firstStep = firstStep, .lastStep = lastStep};
    if (slow) {
      named[rank] = true;
      v.events.push_back(e);
    } else if (wasNamed && factor < recoverBelow) {
      named[rank] = false;
      e.recovered = true;
      v.events.push_back(e);
    }
  }
  return v;
}

}  // namespace fsdp::stragglers
