// The workers' environment: torchrun's variables and fsdprun's own, on top of the agent's.
#include "fsdp/launcher/agent.hpp"

#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::launcher {

std::string pythonModuleDir() {
  const auto holds = [](const std::filesystem::path& dir) {
    std::error_code ec;
    return std::filesystem::is_regular_file(dir / "fsdprun" / "__init__.py", ec);
  };
  if (const char* dir = std::getenv("FSDPRUN_PYTHON_DIR"); dir != nullptr && *dir != '\0') {
    return holds(dir) ? std::string(dir) : std::string();
  }
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  const auto bin = exe.parent_path();
  // A build tree (build/bin/fsdprun, build/python/fsdprun), or an installed prefix
  // (<prefix>/bin/fsdprun, <prefix>/lib/fsdprun/python/fsdprun).
  for (const auto& dir : {bin.parent_path() / "python", bin.parent_path() / "lib" / "fsdprun" / "python"}) {
    if (holds(dir)) return dir.lexically_normal().string();
  }
  return "";
}

bool setsOneOmpThread(const LaunchOptions& options, bool userSetOmp) {
  return !userSetOmp && options.nprocPerNode > 1;
}

std::vector<std::string> workerEnvironment(const LaunchOptions& options, const WorkerIdentity& id,
                                           const WorkerContact& contact,
                                           std::vector<std::string> base) {
  std::map<std::string, std::string> set = {
      {"RANK", std::to_string(id.rank)},
      {"LOCAL_RANK", std::to_string(id.localRank)},
      {"WORLD_SIZE", std::to_string(id.worldSize)},
      {"LOCAL_WORLD_SIZE", std::to_string(id.localWorldSize)},
      {"GROUP_RANK", std::to_string(id.groupRank)},
      {"GROUP_WORLD_SIZE", std::to_string(id.groupWorldSize)},
      {"ROLE_RANK", std::to_string(id.rank)},
      {"ROLE_WORLD_SIZE", std::to_string(id.worldSize)},
      {"ROLE_NAME", options.role},
      {"MASTER_ADDR", contact.masterAddr},
      {"MASTER_PORT", std::to_string(contact.masterPort)},
      {"TORCHELASTIC_RUN_ID", options.rdzvId},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(id.restartCount)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(options.maxRestarts)},
      {"TORCHELASTIC_USE_AGENT_STORE", contact.agentStore ? "True" : "False"},
      {"FSDPRUN_STORE_ADDR", contact.storeHost},
      {"FSDPRUN_STORE_PORT", std::to_string(contact.storePort)},
      {"FSDPRUN_ROUND", std::to_string(id.round)},
      {"FSDPRUN_LOCAL_ADDR", contact.localAddress},
  };
  if (!contact.tokenFile.empty()) set["FSDPRUN_TOKEN_FILE"] = contact.tokenFile;
  if (!contact.errorFile.empty()) set["TORCHELASTIC_ERROR_FILE"] = contact.errorFile;
  if (!contact.node.empty()) set["FSDPRUN_NODE"] = contact.node;
  if (!contact.snapshotSocket.empty()) {
    set["FSDPRUN_SNAPSHOT_SOCKET"] = contact.snapshotSocket;
    set["FSDPRUN_SNAPSHOT_PEER"] = contact.snapshotPeer;
    set["FSDPRUN_SNAPSHOT_MEMORY_LIMIT"] = std::to_string(options.snapshotMemoryLimit);
  }
  std::vector<std::string> env;
  bool haveOmp = false;
  bool haveTunables = false;
  bool haveNcclErrors = false;
  // fsdprun's Python module (`import fsdprun`), after the user's own entries.
  const std::string python = pythonModuleDir();
  bool havePythonPath = false;
  for (auto& entry : base) {
    const std::string key = entry.substr(0, entry.find('='));
    if (key == "OMP_NUM_THREADS") haveOmp = true;
    if (key == "GLIBC_TUNABLES") haveTunables = true;
    if (key == "TORCH_NCCL_ASYNC_ERROR_HANDLING") haveNcclErrors = true;
    if (key == "PYTHONPATH" && !python.empty()) {
      havePythonPath = true;
      const std::string value = entry.substr(entry.find('=') + 1);
      entry = "PYTHONPATH=" + (value.empty() ? python : value + ":" + python);
    }
    // A token left in the agent's own environment never reaches the workers.
    if (key == "FSDPRUN_TOKEN") continue;
    if (!set.contains(key)) env.push_back(std::move(entry));
  }
  // As torchrun: one OpenMP thread per worker where several share the node (they would otherwise
  // each take every core); a single worker keeps LibTorch's default. A user's setting wins.
  if (setsOneOmpThread(options, haveOmp)) env.push_back("OMP_NUM_THREADS=1");
  // glibc's malloc asks for transparent huge pages on the memory it maps (glibc 2.35+; older
  // ones and other allocators ignore it). A training step's large tensors then fault in 2 MB at a
  // time instead of 4 KB: fewer faults every step, a faster restart (a worker's start-up and a
  // snapshot's restore touch gigabytes) and a faster exit. A GLIBC_TUNABLES of the user's wins.
  if (!haveTunables) env.push_back("GLIBC_TUNABLES=glibc.malloc.hugetlb=1");
  // As torchrun: a NCCL collective that fails or times out aborts the communicator and raises in
  // the worker (which the agent then restarts), rather than hanging. A user's setting wins.
  if (!haveNcclErrors) env.push_back("TORCH_NCCL_ASYNC_ERROR_HANDLING=1");
  if (!havePythonPath && !python.empty()) env.push_back("PYTHONPATH=" + python);
  for (const auto& [key, value] : set) env.push_back(key + "=" + value);
  return env;
}

}  // namespace fsdp::launcher
