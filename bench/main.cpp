// fsdp-bench NAME [--flag value ...] | --list | --all
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <cerrno>
#include <iostream>

#include "bench.hpp"
#include "fsdp/common/env.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"

namespace fsdp::bench {

std::vector<long long> Args::ints(const std::string& name, const std::string& fallback) const {
  const auto it = values_.find(name);
  const std::string text = it == values_.end() ? fallback : it->second;
  std::vector<long long> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const auto end = std::min(text.find(',', start), text.size());
    const auto n = parseInt(text.substr(start, end - start));
    if (!n || *n < 1) {
      throw ConfigError("--" + name + " '" + text + "': expected positive integers separated by commas");
    }
    out.push_back(*n);
    start = end + 1;
  }
  return out;
}

std::string Args::str(const std::string& name, const std::string& fallback) const {
  const auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

void emit(const nlohmann::json& line) { std::cout << line.dump() << std::endl; }

std::string selfExe() {
  std::string path(4096, '\0');
  const auto n = ::readlink("/proc/self/exe", path.data(), path.size() - 1);
  if (n <= 0) throwErrno("readlink /proc/self/exe", errno);
  path.resize(static_cast<std::size_t>(n));
  return path;
}

double procStatusMb(int pid, const std::string& field) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.starts_with(field)) return std::stod(line.substr(field.size())) / 1024.0;
  }
  return 0;
}

double percentile(std::vector<double>& samples, double p) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const auto index = static_cast<std::size_t>(p * static_cast<double>(samples.size() - 1) + 0.5);
  return samples[std::min(index, samples.size() - 1)];
}

std::uint16_t freePort() {
  // Port 0 on loopback, read back, closed: the peer's TCPStore binds it right after.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    throwErrno("bench: finding a free port", err);
  }
  const auto port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

}  // namespace fsdp::bench

int main(int argc, char** argv) {
  using namespace fsdp::bench;
  fsdp::log::setup({.role = "fsdp-bench", .defaultLevel = spdlog::level::warn});
  const std::vector<Bench> benches = {
      {"store_ops",
       "set/get/add throughput and p50/p99 latency, ours vs c10d::TCPStore (--clients 1,16,256)",
       {"clients", "ops"},
       storeOps},
      {"rdzv_join",
       "N agents join one round of fsdprun-rdzv: first JOIN sent to last assignment received, "
       "server RSS (--agents 100,1000,10000)",
       {"agents"},
       rdzvJoin},
      {"store_init",
       "N clients connect, add(init,1) and wait for the count to reach N, ours vs c10d::TCPStore "
       "1.13, medians of alternating reps; clients: LibTorch's own (a thread each) and/or "
       "event-driven wire clients, the same for every server; --nodes K adds ours with the "
       "clients spread over K node processes, each through its own store proxy (--clients "
       "1000,10000 --server ours|c10d|both --client libtorch|wire|both --reps 3 --c10d_fds "
       "as_shipped|presized; no --nodes by default)",
       {"clients", "server", "client", "reps", "nodes", "c10d_fds"},
       storeInit},
      {"store_abuse",
       "fsdprun-rdzv's RSS with clients that never read their replies, caps off vs on; 100 "
       "well-behaved clients' store_init barrier quiet vs during a storm of --storm (1000) "
       "abusive clients: never reading, half frames, connect-close loops (--reps 3; --kinds 012 picks "
       "which of the three, in that order)",
       {"clients", "storm", "reps", "kinds"},
       storeAbuse},
      {"launch",
       "fsdprun vs torchrun (--monitor_interval 0.1): --standalone --nproc_per_node N: wall of a "
       "/bin/true job, start -> every worker started (--n 1,2,4,8 --reps 5)",
       {"n", "reps", "torchrun"},
       launch},
      {"restart",
       "fsdprun vs torchrun (--monitor_interval 0.1): rank 0 exits 1 once; its exit -> every "
       "restarted worker running, 1 node x 2 workers and 2 agents x 1 worker "
       "(--setups standalone2,agents2 --reps 5)",
       {"setups", "reps", "torchrun"},
       restart},
      {"multi_agent",
       "fsdprun vs torchrun (--monitor_interval 0.1): K agents on loopback, start -> every worker "
       "started, agent peak RSS (--agents 2,4,8,16 --reps 3)",
       {"agents", "reps", "torchrun"},
       multiAgent},
      {"fsdp_train",
       "DeepNet (--model deep|shallow|gpt) for --steps on 2 ranks x 1 thread per FSDP strategy, one "
       "LibTorch process x 2 threads, PyTorch DDP on Gloo 2 x 1 and PyTorch 1 x 2: samples/s over "
       "every step and past the first 2 (steady), peak RSS; --reps runs of each, alternating, and "
       "the medians of the per-rep ratios (--strategies FULL_SHARD,SHARD_GRAD_OP,NO_SHARD "
       "--batch_size 256 --reps 1); gpt: 12 layers d=768, FULL_SHARD 2 ranks vs one process, "
       "per-rank peak RSS ratio; --numa exclusive|node|socket|core-complex also runs FULL_SHARD under "
       "fsdprun --numa_binding and compares it with the unbound run",
       {"model", "steps", "batch_size", "strategies", "reps", "numa"},
       fsdpTrain},
      {"accuracy",
       "mnist test accuracy after --epochs (1) of the recipe (Adam 1e-3, batch 256, dropout): FSDP "
       "FULL_SHARD 2 ranks vs one PyTorch process (--model deep|shallow)",
       {"model", "epochs"},
       accuracy},
      {"recovery",
       "a worker (or a whole agent) SIGKILLed at a random step: steps redone, kill -> state restored "
       "and -> first new step; fsdprun's in-memory snapshots (1 agent x 2 workers, 2 agents x 1, agent "
       "kill in --nnodes 1:2: the peer copy) vs torchrun + DDP + torch.save every --checkpoint_every "
       "(10,50) steps (DeepNet), and the same DDP script under fsdprun with import fsdprun (restore, "
       "snapshot every step); and the snapshots' per-step cost (libfsdp's and the Python module's), --snapshot_every 1 vs 0; "
       "each fsdprun kill in both --restart_modes on the same kill (auto: the survivors re-form in process; process: "
       "every worker starts again): the recovery overhead (kill -> first new step, less one median step) and "
       "whether the survivors kept their pids (--models "
       "deep,gpt --steps 24 --batch_size 32 --reps 1 --seed N --torchrun 0|1 --standby 1|0 (fsdprun "
       "--standby) --restart_modes auto,process --cases worker,agents_worker,agent,overhead)",
       {"models", "steps", "batch_size", "reps", "seed", "torchrun", "standby", "cases", "checkpoint_every",
        "restart_modes"},
       recovery},
      {"hang",
       "a 3-rank DeepNet job whose rank 1 freezes after --stall_step (6): seconds from the stall to "
       "the hang report, to the state restored and to the first new step, with --hang_timeout 5, "
       "auto and off (the communicator's 300 s timeout); a rank stalled just before a checkpoint save "
       "while the others wait in it (save: stall_worker, --hang_timeout 5); and the flight recorder's cost: ns per "
       "recorded collective, collectives per DeepNet step, their share of a step, and step times "
       "with it on vs off, alternating --reps (2) (--cases 5,save,auto,off,cost --steps 20)",
       {"cases", "steps", "stall_step", "reps"},
       hang},
      {"collectives",
       "all-gather / reduce-scatter / all-reduce: our shared-memory communicator vs our Gloo one vs "
       "torch.distributed Gloo (--mb 1,16,128 --ranks 2,4 --reps 5)",
       {"mb", "ranks", "reps"},
       collectives},
      {"telemetry",
       "libfsdp's step timing and the agent's /metrics: the 3-rank DeepNet job of hang with "
       "FSDPRUN_STEP_TIMING=1 vs 0, and the recorder's hot paths timed with it on and off (child "
       "processes); the same job with --metrics_port scraped back to back vs not scraped: step times, "
       "scrapes/s, scrape latency, page size; alternating --reps (2) (--cases timing,scrape --steps 24)",
       {"cases", "steps", "reps"},
       telemetry},
  };
  if (argc < 2) {
    std::cerr << "usage: fsdp-bench NAME [--flag value ...] | --list | --all\n";
    return 2;
  }
  const std::string first = argv[1];
  try {
    if (first == "rdzv_join_helper" && argc == 5) {
      return rdzvJoinHelper(static_cast<std::uint16_t>(std::stoi(argv[2])), std::stoi(argv[3]), std::stoi(argv[4]));
    }
    if (first == "store_init_helper" && argc == 6) {
      return storeInitHelper(argv[2], static_cast<std::uint16_t>(std::stoi(argv[3])), std::stoi(argv[4]),
                             std::stoi(argv[5]));
    }
    if (first == "store_init_wire_helper" && argc == 6) {
      return storeInitWireHelper(argv[2], static_cast<std::uint16_t>(std::stoi(argv[3])), std::stoi(argv[4]),
                                 std::stoi(argv[5]));
    }
    if (first == "c10d_server" && argc == 3) return c10dServer(std::string(argv[2]) == "presized");
    if (first == "collectives_worker" && argc == 4) return collectivesWorker(argv[2], std::stoi(argv[3]));
    if (first == "telemetry_micro" && argc == 2) return telemetryMicro();
  } catch (const std::exception& e) {
    std::cout << "error: " << e.what() << std::endl;
    return 1;
  }
  if (first == "--list") {
    for (const auto& b : benches) std::cout << b.name << "\t" << b.help << "\n";
    return 0;
  }
  try {
    if (first == "--all") {
      for (const auto& b : benches) b.run(Args({}));
      return 0;
    }
    std::map<std::string, std::string> values;
    for (int i = 2; i < argc; i += 2) {
      const std::string flag = argv[i];
      if (!flag.starts_with("--") || i + 1 >= argc) {
        throw fsdp::ConfigError("'" + flag + "': expected --flag value pairs");
      }
      values[flag.substr(2)] = argv[i + 1];
    }
    for (const auto& b : benches) {
      if (b.name != first) continue;
      for (const auto& [flag, value] : values) {
        if (std::find(b.flags.begin(), b.flags.end(), flag) == b.flags.end()) {
          throw fsdp::ConfigError("--" + flag + ": not a flag of bench '" + b.name + "'");
        }
      }
      b.run(Args(values));
      return 0;
    }
    throw fsdp::ConfigError("unknown bench '" + first + "' (fsdp-bench --list names them)");
  } catch (const fsdp::ConfigError& e) {
    std::cerr << "fsdp-bench: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-bench: error: " << e.what() << "\n";
    return 1;
  }
}
