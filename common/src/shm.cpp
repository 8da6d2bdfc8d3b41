#include "fsdp/common/shm.hpp"

#include <sys/mman.h>

#include <cctype>
#include <filesystem>
#include <system_error>

namespace fsdp {

std::string shmSegmentPrefix(const std::string& runId, long agentPid) {
  std::string prefix = "fsdprun-";
  for (const unsigned char c : runId) {
    prefix += std::isalnum(c) != 0 || c == '_' || c == '.' ? static_cast<char>(c) : '_';
  }
  return prefix + "-" + std::to_string(agentPid) + "-";
}

int removeShmSegments(const std::string& runId, long agentPid) {
  const std::string prefix = shmSegmentPrefix(runId, agentPid);
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0 && ::shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  return removed;
}

}  // namespace fsdp
