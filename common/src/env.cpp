#include "fsdp/common/env.hpp"

#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "fsdp/common/error.hpp"

namespace fsdp {

EnvLookup processEnv() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

EnvLookup mapEnv(std::map<std::string, std::string> values) {
  return [values = std::move(values)](const std::string& name) -> std::optional<std::string> {
    const auto it = values.find(name);
    if (it == values.end()) return std::nullopt;
    return it->second;
  };
}

std::optional<long long> parseInt(const std::string& text) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text.front()))) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) return std::nullopt;
  return value;
}

std::optional<double> parseDouble(const std::string& text) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text.front()))) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (errno != 0 || end != text.c_str() + text.size() || !std::isfinite(value)) return std::nullopt;
  return value;
}

long long envInt(const EnvLookup& env, const std::string& name, long long fallback) {
  const auto raw = env(name);
  if (!raw) return fallback;
  const auto value = parseInt(*raw);
  if (!value) {
    throw ConfigError("environment variable " + name + "='" + *raw + "': expected an integer");
  }
  return *value;
}

bool envFlag(const EnvLookup& env, const std::string& name, bool fallback) {
  const auto raw = env(name);
  if (!raw) return fallback;
  if (*raw == "0" || *raw == "1") return *raw == "1";
  throw ConfigError("environment variable " + name + "='" + *raw + "': expected 0 or 1");
}

long long requireEnvInt(const EnvLookup& env, const std::string& name) {
  if (!env(name)) {
    throw ConfigError("environment variable " + name +
                      " is not set: expected an integer (start this program with fsdprun)");
  }
  return envInt(env, name, 0);
}

std::string requireEnv(const EnvLookup& env, const std::string& name) {
  const auto raw = env(name);
  if (!raw || raw->empty()) {
    throw ConfigError("environment variable " + name +
                      " is not set: start this program with fsdprun");
  }
  return *raw;
}

}  // namespace fsdp
