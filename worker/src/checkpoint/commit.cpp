// Committing a step directory (COMMIT marker, rename, directory sync), removing leftover
// .step_ directories, pruning beyond `keep`, and finding the newest committed checkpoint.
#include <algorithm>

#include "checkpoint_internal.hpp"

namespace fsdp::worker {
namespace detail {
namespace {

// The committed checkpoints of `dir`, oldest first (the names sort by step).
std::vector<std::string> completeCheckpoints(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> complete;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (isStepDirName(entry.path().filename().string()) && fs::exists(entry.path() / "COMMIT")) {
      complete.push_back(entry.path().string());
    }
  }
  std::sort(complete.begin(), complete.end());
  return complete;
}

}  // namespace

// Renames a fully written directory into place and keeps the newest `keep` checkpoints.
void commit(const std::string& dir, const std::string& tmp, const std::string& final, int keep) {
  writeFileDurably(tmp + "/COMMIT", "complete\n");
  syncDirectory(tmp);
  std::error_code ec;
  if (fs::exists(final)) fs::remove_all(final, ec);  // the same step saved by an earlier attempt
  fs::rename(tmp, final, ec);
  if (ec) throw Error("checkpoint: renaming " + tmp + " to " + final + ": " + ec.message());
  syncDirectory(dir);
  // Unfinished directories of this step or older ones (earlier attempts). Newer ones stay:
  // with asynchronous saves, another rank may already be writing the next step.
  const std::string committed = fs::path(final).filename().string();
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with(".step_") && name.substr(1, committed.size()) <= committed) {
      fs::remove_all(entry.path(), ec);
    }
  }
  // Complete checkpoints beyond `keep`.
  const auto complete = completeCheckpoints(dir);
  if (keep > 0 && static_cast<int>(complete.size()) > keep) {
    for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < complete.size(); ++i) {
      fs::remove_all(complete[i], ec);
    }
  }
}

}  // namespace detail

using namespace detail;

std::optional<std::string> newestCheckpoint(const std::string& dir) {
  const auto complete = completeCheckpoints(dir);
  if (complete.empty()) return std::nullopt;
  return complete.back();
}

}  // namespace fsdp::worker
