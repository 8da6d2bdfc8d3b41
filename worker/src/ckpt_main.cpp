// fsdp-ckpt: look into, consolidate and reshard fsdprun's sharded checkpoints, offline.
//   fsdp-ckpt inspect DIR                  check every file and block; print what is inside
//   fsdp-ckpt consolidate DIR OUT.pt       {name: tensor} for Python's torch.load
//   fsdp-ckpt reshard DIR OUT --world N    the same checkpoint laid out for N ranks
// DIR is a checkpoint (step_*) or a checkpoint directory (its newest complete checkpoint).
// Exit codes: 0 success, 1 failure, 2 bad usage or a bad checkpoint.
#include <filesystem>
#include <iostream>

#include "fsdp/common/env.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/worker/checkpoint.hpp"

namespace {

constexpr const char* kUsage =
    "usage: fsdp-ckpt inspect DIR | consolidate DIR OUT.pt | reshard DIR OUT --world N\n"
    "  DIR: a checkpoint (step_*) or a directory of checkpoints (its newest complete one)\n";

std::string resolve(const std::string& dir) {
  namespace fs = std::filesystem;
  if (!fs::exists(dir)) throw fsdp::ConfigError("DIR '" + dir + "' does not exist");
  if (fs::exists(fs::path(dir) / "metadata.json") || fs::exists(fs::path(dir) / "COMMIT")) return dir;
  if (const auto newest = fsdp::worker::newestCheckpoint(dir)) return *newest;
  throw fsdp::ConfigError("DIR '" + dir + "' holds no complete checkpoint (no step_* directory with a COMMIT marker)");
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.empty() || args[0] == "--help" || args[0] == "-h") {
      std::cout << kUsage;
      return args.empty() ? 2 : 0;
    }
    const std::string& command = args[0];
    if (command == "inspect" && args.size() == 2) {
      std::cout << fsdp::worker::inspectCheckpoint(resolve(args[1]));
      return 0;
    }
    if (command == "consolidate" && args.size() == 3) {
      const std::string path = resolve(args[1]);
      fsdp::worker::consolidateCheckpoint(path, args[2]);
      std::cout << "wrote " << args[2] << " from " << path << "\n";
      return 0;
    }
    if (command == "reshard" && args.size() == 5 && args[3] == "--world") {
      const auto world = fsdp::parseInt(args[4]);
      if (!world || *world < 1 || *world > 1'000'000) {
        throw fsdp::ConfigError("--world '" + args[4] + "': expected a positive number of ranks");
      }
      const std::string path = resolve(args[1]);
      fsdp::worker::reshardCheckpoint(path, args[2], static_cast<int>(*world));
      std::cout << "wrote " << args[2] << " (" << *world << " ranks) from " << path << "\n";
      return 0;
    }
    throw fsdp::ConfigError(std::string("bad arguments; ") + kUsage);
  } catch (const fsdp::ConfigError& e) {
    std::cerr << "fsdp-ckpt: error: " + std::string(e.what()) + "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-ckpt: error: " + std::string(e.what()) + "\n";
    return 1;
  }
}
