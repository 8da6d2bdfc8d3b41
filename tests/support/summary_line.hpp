#pragma once
// Test helper: the summary JSON object a training example prints last ({"params_sha256": ...}).

#include <nlohmann/json.hpp>
#include <string>

namespace fsdp::testing {

// The last line of `out` that starts a JSON object; a null json when there is none, a discarded
// one when it does not parse.
inline nlohmann::json summaryOf(const std::string& out) {
  const auto brace = out.rfind("{\"");
  if (brace == std::string::npos) return {};
  return nlohmann::json::parse(out.substr(brace, out.find('\n', brace) - brace), nullptr, false);
}

}  // namespace fsdp::testing
