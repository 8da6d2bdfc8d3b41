#include "fsdp/common/log.hpp"

#include <spdlog/sinks/stdout_sinks.h>
#include <unistd.h>

#include <cstdlib>

namespace fsdp::log {

void setup(const LogOptions& options) {
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  std::string prefix = options.role + " " + host + " pid " + std::to_string(::getpid());
  if (options.rank >= 0) prefix += " rank " + std::to_string(options.rank);

  auto logger = std::make_shared<spdlog::logger>(
      options.role, std::make_shared<spdlog::sinks::stderr_sink_mt>());
  // The prefix is fixed per process; escape '%' so spdlog does not read it as a flag.
  std::string escaped;
  for (char c : prefix) {
    escaped += c;
    if (c == '%') escaped += '%';
  }
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [" + escaped + "] [%l] %v");
  auto level = options.defaultLevel;
  if (const char* env = std::getenv("FSDP_LOG_LEVEL"); env != nullptr && *env != '\0') {
    level = spdlog::level::from_str(env);
  }
  logger->set_level(level);
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(std::move(logger));
}

}  // namespace fsdp::log
