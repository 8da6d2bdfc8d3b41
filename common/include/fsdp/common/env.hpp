#pragma once
// Reading the environment through a seam, so that parsing can be tested with a map.

#include <functional>
#include <map>
#include <optional>
#include <string>

namespace fsdp {

// Looks up one variable; nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// The process environment (getenv).
EnvLookup processEnv();

// A fixed map, for tests.
EnvLookup mapEnv(std::map<std::string, std::string> values);

// Parses a whole string as a base-10 integer; nullopt on anything else (sign allowed,
// no spaces, no trailing characters, no overflow).
std::optional<long long> parseInt(const std::string& text);

// Parses a whole string as a finite double; nullopt otherwise.
std::optional<double> parseDouble(const std::string& text);

// Reads an integer variable; throws ConfigError naming the variable when it is set but not
// an integer, returns `fallback` when unset.
long long envInt(const EnvLookup& env, const std::string& name, long long fallback);

// Reads a switch: 0 or 1 (returned as false or true), `fallback` when unset; throws ConfigError
// naming the variable and its value otherwise.
bool envFlag(const EnvLookup& env, const std::string& name, bool fallback);

// Reads an integer variable that must be set; throws ConfigError naming it otherwise.
long long requireEnvInt(const EnvLookup& env, const std::string& name);

// Reads a string variable that must be set and non-empty.
std::string requireEnv(const EnvLookup& env, const std::string& name);

}  // namespace fsdp
