#include "fsdp/launcher/rdzv_conf.hpp"

#include <cmath>
#include <set>

#include "fsdp/common/env.hpp"
#include "fsdp/common/error.hpp"

namespace fsdp::launcher {
namespace {

ConfigError bad(const std::string& item, const std::string& why) {
  return ConfigError("--rdzv_conf '" + item + "': " + why);
}

std::chrono::milliseconds seconds(const std::string& item, const std::string& value, bool allowZero) {
  const auto v = parseDouble(value);
  if (!v || *v < 0 || (!allowZero && *v == 0) || *v > 1e7) {
    throw bad(item, std::string("expected a ") + (allowZero ? "non-negative" : "positive") +
                        " number of seconds");
  }
  return std::chrono::milliseconds(static_cast<long long>(std::llround(*v * 1000)));
}

bool boolean(const std::string& item, const std::string& value) {
  static const std::set<std::string> yes = {"1", "true", "True", "TRUE", "yes", "on"};
  static const std::set<std::string> no = {"0", "false", "False", "FALSE", "no", "off"};
  if (yes.contains(value)) return true;
  if (no.contains(value)) return false;
  throw bad(item, "expected true or false");
}

}  // namespace

RdzvConf RdzvConf::parse(const std::string& text) {
  RdzvConf conf;
  std::optional<std::chrono::milliseconds> keepAliveInterval;
  std::optional<long long> keepAliveAttempts;
  bool heartbeatTimeoutSet = false;
  std::size_t start = 0;
  while (start < text.size()) {
    const auto end = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, end - start);
    start = end + 1;
    if (item.empty()) continue;
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0) throw bad(item, "expected KEY=VALUE");
    const std::string key = item.substr(0, eq);
    const std::string value = item.substr(eq + 1);
    if (key == "join_timeout") {
      conf.joinTimeout = seconds(item, value, false);
    } else if (key == "last_call_timeout") {
      conf.lastCallTimeout = seconds(item, value, true);
    } else if (key == "close_timeout") {
      conf.closeTimeout = seconds(item, value, true);
    } else if (key == "heartbeat_interval") {
      conf.heartbeatInterval = seconds(item, value, false);
    } else if (key == "heartbeat_timeout") {
      conf.heartbeatTimeout = seconds(item, value, false);
      heartbeatTimeoutSet = true;
    } else if (key == "keep_alive_interval") {  // torchrun's spelling
      keepAliveInterval = seconds(item, value, false);
    } else if (key == "keep_alive_max_attempt") {
      const auto n = parseInt(value);
      if (!n || *n < 1 || *n > 1000) throw bad(item, "expected a positive integer");
      keepAliveAttempts = *n;
    } else if (key == "is_host") {
      conf.isHost = boolean(item, value);
    } else if (key == "token_file") {
      if (value.empty()) throw bad(item, "expected a file path");
      conf.tokenFile = value;
    } else if (key == "allow_pytorch_clients") {
      conf.allowPytorchClients = boolean(item, value);
    } else if (key == "store_proxy") {
      conf.storeProxy = boolean(item, value);
    } else if (key == "read_timeout" || key == "timeout" || key == "store_type" || key == "use_libuv") {
      // torchrun's, with no meaning here: accepted so that existing command lines work.
      conf.ignored.push_back(item + ": torchrun's TCPStore setting; fsdprun's store has its own (join_timeout "
                                    "bounds the rendezvous, heartbeat_timeout a silent peer)");
    } else if (key == "local_addr") {
      conf.ignored.push_back(item + ": give --local_addr instead");
    } else {
      // torchrun carries unknown keys to custom rendezvous handlers; fsdprun has none.
      conf.ignored.push_back(item + ": not a key fsdprun knows (known: join_timeout, last_call_timeout, "
                                    "close_timeout, heartbeat_interval, heartbeat_timeout, keep_alive_interval, "
                                    "keep_alive_max_attempt, is_host, token_file, allow_pytorch_clients, "
                                    "store_proxy)");
    }
  }
  if (keepAliveInterval) conf.heartbeatInterval = *keepAliveInterval;
  if (!heartbeatTimeoutSet && (keepAliveInterval || keepAliveAttempts)) {
    conf.heartbeatTimeout = conf.heartbeatInterval * keepAliveAttempts.value_or(3);
  }
  if (conf.heartbeatTimeout <= conf.heartbeatInterval) {
    throw ConfigError("--rdzv_conf: heartbeat_timeout (" +
                      std::to_string(conf.heartbeatTimeout.count()) +
                      " ms) must be longer than heartbeat_interval (" +
                      std::to_string(conf.heartbeatInterval.count()) + " ms)");
  }
  return conf;
}

}  // namespace fsdp::launcher
