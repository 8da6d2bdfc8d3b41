#pragma once
// Logging for every part, on stderr. Level from FSDP_LOG_LEVEL (trace, debug, info, warn,
// error, off; default warn for workers and info for tools). Each line carries role, host,
// pid and rank once. ERROR: a person must act; WARN: degraded; INFO: lifecycle; DEBUG: per
// request.

#include <spdlog/spdlog.h>

#include <string>

namespace fsdp::log {

struct LogOptions {
  std::string role = "fsdp";         // "fsdprun", "rdzv", "worker"
  int rank = -1;                     // shown when >= 0
  spdlog::level::level_enum defaultLevel = spdlog::level::info;
};

// Installs the default logger. Safe to call more than once (the last call wins).
void setup(const LogOptions& options);

using spdlog::debug;
using spdlog::error;
using spdlog::info;
using spdlog::warn;

}  // namespace fsdp::log
