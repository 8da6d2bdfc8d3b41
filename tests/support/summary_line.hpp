#pragma once
// Test helpers: the summary JSON object a training example prints last ({"params_sha256": ...}),
// and the lines of the Trainer's JSONL metrics file.

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace fsdp::testing {

// The last line of `out` that starts a JSON object; a null json when there is none, a discarded
// one when it does not parse.
inline nlohmann::json summaryOf(const std::string& out) {
  const auto brace = out.rfind("{\"");
  if (brace == std::string::npos) return {};
  return nlohmann::json::parse(out.substr(brace, out.find('\n', brace) - brace), nullptr, false);
}

// The JSON lines of a metrics file (a partial last line is skipped).
inline std::vector<nlohmann::json> metricsLines(const std::string& path) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object()) lines.push_back(std::move(j));
  }
  return lines;
}

}  // namespace fsdp::testing
