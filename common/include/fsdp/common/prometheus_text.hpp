#pragma once
// A builder of the Prometheus text exposition format, version 0.0.4
// (https://prometheus.io/docs/instrumenting/exposition_formats/). Pure: no I/O, no clock.
//
//   prom::TextWriter w;
//   w.family("fsdp_step_seconds", "gauge", "Duration of the last training step.");
//   w.sample({{"rank", "0"}}, 0.25);
//   std::string body = w.take();
//
// Not thread-safe: one writer per rendering.

#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

namespace fsdp::prom {

struct Label {
  std::string name;
  std::string value;
};
using Labels = std::vector<Label>;

class TextWriter {
 public:
  // Starts a metric family: "# HELP name help\n# TYPE name type\n". Families are written in the
  // order started; samples go under the last family started. `type` is one of "counter",
  // "gauge", "untyped", "histogram", "summary". Throws std::invalid_argument on a bad name
  // ([a-zA-Z_:][a-zA-Z0-9_:]*) or type, std::logic_error on a name already started since the
  // last take() (the format allows one block per family). Both are programming errors.
  void family(std::string_view name, std::string_view type, std::string_view help);

  // A sample of the current family: `name{label="value",...} value\n` (no braces without
  // labels). Throws std::logic_error before any family(), std::invalid_argument on a bad or
  // repeated label name ([a-zA-Z_][a-zA-Z0-9_]*). Label values are escaped, so any bytes go.
  void sample(const Labels& labels, double value);

  // The same under a name of the family's own with a suffix, e.g. "foo_total", "foo_bucket"
  // in family "foo". Throws std::invalid_argument unless `suffixedName` is a valid metric name
  // that starts with the current family's name.
  void sample(std::string_view suffixedName, const Labels& labels, double value);

  // The text so far; the writer is left empty, as if new (the families are forgotten).
  std::string take();

 private:
  std::string text_;
  std::string current_;                      // the family samples go under; "" before any
  std::unordered_set<std::string> started_;  // every family started since the last take()
};

// The pieces, exposed for tests and for callers that format by hand.
bool isValidMetricName(std::string_view name);
bool isValidLabelName(std::string_view name);
// Backslash, double quote and newline escaped (label values).
std::string escapeLabelValue(std::string_view value);
// Backslash and newline escaped (HELP text).
std::string escapeHelp(std::string_view help);
// Integers (|v| < 2^53) without exponent or point, "NaN", "+Inf", "-Inf", otherwise the
// shortest text that reads back as the same double.
std::string formatValue(double value);

}  // namespace fsdp::prom
