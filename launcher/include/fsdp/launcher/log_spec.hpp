#pragma once
// Where worker output goes, as torchrun's -r/--redirects, -t/--tee and --local_ranks_filter
// say it: "3" for every local rank, or "0:1,1:2" per local rank; bit 1 = stdout, bit 2 =
// stderr. A redirected stream goes to its log file only; a tee'd one to the file and to the
// console with a "[rank<N>]:" prefix.

#include <map>
#include <optional>
#include <set>
#include <string>

namespace fsdp::launcher {

inline constexpr int kStdout = 1;
inline constexpr int kStderr = 2;

struct StreamSpec {
  std::optional<int> all;      // the same for every local rank
  std::map<int, int> perRank;  // local rank -> bits
  // The bits for one local rank (0 when none).
  int forRank(int localRank) const;
  bool any() const { return all.value_or(0) != 0 || !perRank.empty(); }
  // Throws ConfigError naming `flag` and the value.
  static StreamSpec parse(const std::string& text, const std::string& flag);
};

// "0,2": the local ranks whose output reaches the console. Throws ConfigError.
std::set<int> parseLocalRanksFilter(const std::string& text);

}  // namespace fsdp::launcher
