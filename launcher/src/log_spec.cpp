#include "fsdp/launcher/log_spec.hpp"

#include "fsdp/common/env.hpp"
#include "fsdp/common/error.hpp"

namespace fsdp::launcher {
namespace {

int streamBits(const std::string& text, const std::string& flag, const std::string& whole) {
  const auto n = parseInt(text);
  if (!n || *n < 0 || *n > 3) {
    throw ConfigError(flag + " '" + whole +
                      "': expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), for every "
                      "local rank or as LOCAL_RANK:BITS,...");
  }
  return static_cast<int>(*n);
}

}  // namespace

int StreamSpec::forRank(int localRank) const {
  if (const auto it = perRank.find(localRank); it != perRank.end()) return it->second;
  return all.value_or(0);
}

StreamSpec StreamSpec::parse(const std::string& text, const std::string& flag) {
  StreamSpec spec;
  if (text.empty()) return spec;
  if (text.find(':') == std::string::npos) {
    spec.all = streamBits(text, flag, text);
    return spec;
  }
  std::size_t start = 0;
  while (start <= text.size()) {
    const auto end = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, end - start);
    start = end + 1;
    const auto colon = item.find(':');
    const auto rank = colon == std::string::npos ? std::nullopt : parseInt(item.substr(0, colon));
    if (!rank || *rank < 0 || *rank > 65535) {
      throw ConfigError(flag + " '" + text + "': '" + item + "' is not LOCAL_RANK:BITS");
    }
    spec.perRank[static_cast<int>(*rank)] = streamBits(item.substr(colon + 1), flag, text);
  }
  return spec;
}

std::set<int> parseLocalRanksFilter(const std::string& text) {
  std::set<int> ranks;
  std::size_t start = 0;
  while (start <= text.size()) {
    const auto end = std::min(text.find(',', start), text.size());
    const auto rank = parseInt(text.substr(start, end - start));
    if (!rank || *rank < 0 || *rank > 65535) {
      throw ConfigError("--local_ranks_filter '" + text + "': expected local ranks like 0,1,2");
    }
    ranks.insert(static_cast<int>(*rank));
    start = end + 1;
  }
  return ranks;
}

}  // namespace fsdp::launcher
