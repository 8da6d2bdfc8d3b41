// launch: wall time of a standalone job of N /bin/true workers, fsdprun vs torchrun at its
// fastest setting (--monitor_interval 0.1), alternating runs in the same invocation.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>

#include "bench.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"

namespace fsdp::bench {
namespace {

// Runs a command with output discarded; returns wall milliseconds, or -1 when it failed.
double timeCommand(const std::vector<std::string>& argv) {
  SpawnOptions options{.argv = argv, .env = currentEnvironment()};
  options.stdoutPath = "/dev/null";
  options.stderrPath = "/dev/null";
  const auto start = std::chrono::steady_clock::now();
  auto child = ChildProcess::spawn(options);
  const auto status = child.waitFor(std::chrono::seconds(120));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (!status || !WIFEXITED(*status) || WEXITSTATUS(*status) != 0) return -1;
  return ms;
}


}  // namespace

void launch(const Args& args) {
  const auto ns = args.ints("n", "1,2,4,8");
  const int reps = static_cast<int>(args.ints("reps", "5").front());
  const std::string torchrun = args.str("torchrun", "../shared/peer-torchrun/torchrun_fixed");
  const std::string exe = selfExe();
  const std::string fsdprun = exe.substr(0, exe.rfind('/')) + "/fsdprun";
  const bool havePeer = ::access(torchrun.c_str(), R_OK) == 0 && ::access("/usr/bin/python3", X_OK) == 0;
  for (const long long n : ns) {
    std::vector<double> ours, peer;
    for (int r = 0; r < reps; ++r) {
      ours.push_back(timeCommand({fsdprun, "--standalone", "--nproc_per_node", std::to_string(n), "/bin/true"}));
      if (havePeer) {
        peer.push_back(timeCommand({"/usr/bin/python3", torchrun, "--standalone", "--nnodes", "1",
                                    "--nproc_per_node", std::to_string(n), "--monitor_interval", "0.1",
                                    "--no_python", "/bin/true"}));
      }
    }
    const bool oursOk = std::none_of(ours.begin(), ours.end(), [](double v) { return v < 0; });
    const bool peerOk = havePeer && std::none_of(peer.begin(), peer.end(), [](double v) { return v < 0; });
    nlohmann::json line = {{"bench", "launch"}, {"nproc_per_node", n}, {"reps", reps},
                           {"fsdprun_wall_ms_median", oursOk ? percentile(ours, 0.5) : -1}};
    if (peerOk) {
      line["torchrun_wall_ms_median"] = percentile(peer, 0.5);
      line["speedup"] = percentile(peer, 0.5) / percentile(ours, 0.5);
    } else {
      line["torchrun"] = havePeer ? "failed" : "unavailable: needs python3-torch and " + torchrun;
    }
    emit(line);
  }
}

}  // namespace fsdp::bench
