#include "fsdp/launcher/options.hpp"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <thread>

#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"

namespace fsdp::launcher {
namespace {

constexpr const char* kVersion = "fsdprun 0.1.0";

std::optional<int> positiveInt(const std::string& value) {
  const auto n = parseInt(value);
  if (!n || *n < 1 || *n > 1'000'000) return std::nullopt;
  return static_cast<int>(*n);
}

}  // namespace

int parseNprocPerNode(const std::string& value, int cpus, int gpus) {
  if (const auto n = positiveInt(value)) return *n;
  if (value == "cpu") return cpus;
  if (value == "auto") return gpus > 0 ? gpus : cpus;
  if (value == "gpu") {
    if (gpus > 0) return gpus;
    throw ConfigError("--nproc_per_node 'gpu': no GPU found on this node");
  }
  throw ConfigError("--nproc_per_node '" + value +
                    "': expected a positive integer, 'auto', 'cpu' or 'gpu'");
}

std::pair<int, int> parseNnodes(const std::string& value) {
  const auto colon = value.find(':');
  const auto bad = [&value](const std::string& why) {
    return ConfigError("--nnodes '" + value + "': " + why);
  };
  if (colon == std::string::npos) {
    const auto n = positiveInt(value);
    if (!n) throw bad("expected a positive integer N or MIN:MAX");
    return {*n, *n};
  }
  const auto lo = positiveInt(value.substr(0, colon));
  const auto hi = positiveInt(value.substr(colon + 1));
  if (!lo || !hi) throw bad("expected MIN:MAX with positive integers");
  if (*lo > *hi) throw bad("MIN is larger than MAX");
  return {*lo, *hi};
}

ParseResult parseCommandLine(int argc, const char* const* argv, const EnvLookup& env) {
  CLI::App app{"fsdprun: launch a (fully sharded) data-parallel training job.\n"
               "Usage: fsdprun [options] PROGRAM [ARGS...]",
               "fsdprun"};
  app.prefix_command();
  app.set_version_flag("--version", kVersion);
  LaunchOptions o;
  std::string nnodes = "1";
  std::string nproc = "1";
  std::string shutdownTimeout = "30";
  std::string masterPort;
  std::string monitorInterval = "0.1";
  std::string maxRestarts = "0";

  // PET_<NAME> fallbacks, as torchrun: applied before parsing, overridden by flags.
  const auto pet = [&env](const char* name, std::string& target) {
    if (auto v = env(std::string("PET_") + name)) target = *v;
  };
  pet("NNODES", nnodes);
  pet("NPROC_PER_NODE", nproc);
  pet("MAX_RESTARTS", maxRestarts);
  pet("MONITOR_INTERVAL", monitorInterval);
  pet("RDZV_BACKEND", o.rdzvBackend);
  pet("RDZV_ENDPOINT", o.rdzvEndpoint);
  pet("RDZV_ID", o.rdzvId);
  pet("ROLE", o.role);
  pet("MASTER_ADDR", o.masterAddr);
  pet("MASTER_PORT", masterPort);
  if (auto v = env("PET_STANDALONE")) o.standalone = (*v == "1" || *v == "true");

  const char* kGroupWorkers = "Worker/node size";
  const char* kGroupRdzv = "Rendezvous";
  const char* kGroupUser = "User-code launch";
  app.add_option("--nnodes", nnodes, "Number of nodes, N or MIN:MAX")->group(kGroupWorkers);
  app.add_option("--nproc_per_node,--nproc-per-node", nproc,
                 "Workers per node: N, auto, cpu or gpu")
      ->group(kGroupWorkers);
  app.add_flag("--standalone", o.standalone,
               "Single-node job: an embedded rendezvous store on a free loopback port")
      ->group(kGroupRdzv);
  app.add_option("--rdzv_backend,--rdzv-backend", o.rdzvBackend, "Rendezvous backend")
      ->group(kGroupRdzv);
  app.add_option("--rdzv_endpoint,--rdzv-endpoint", o.rdzvEndpoint, "HOST[:PORT] of the store")
      ->group(kGroupRdzv);
  app.add_option("--rdzv_id,--rdzv-id", o.rdzvId, "Job id, shared by every node")
      ->group(kGroupRdzv);
  app.add_option("--master_addr,--master-addr", o.masterAddr, "MASTER_ADDR given to workers")
      ->group(kGroupRdzv);
  app.add_option("--master_port,--master-port", masterPort,
                 "MASTER_PORT given to workers (default: a free port)")
      ->group(kGroupRdzv);
  app.add_option("--max_restarts,--max-restarts", maxRestarts,
                 "Restarts of the worker group before giving up")
      ->group(kGroupUser);
  app.add_option("--monitor_interval,--monitor-interval", monitorInterval,
                 "Accepted for torchrun compatibility; fsdprun reacts to worker exits at once")
      ->group(kGroupUser);
  app.add_option("--role", o.role, "Role name of the workers (ROLE_NAME)")->group(kGroupUser);
  app.add_flag("--no_python,--no-python", o.noPython,
               "Execute PROGRAM directly, even when it ends in .py")
      ->group(kGroupUser);
  app.add_flag("-m,--module", o.module, "PROGRAM is a Python module (python3 -m)")
      ->group(kGroupUser);
  app.add_option("--shutdown_timeout,--shutdown-timeout", shutdownTimeout,
                 "Seconds between the stop signal and SIGKILL")
      ->group(kGroupUser);
  app.add_flag("--dry_run,--dry-run", o.dryRun, "Print the resolved configuration and exit")
      ->group(kGroupUser);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return {std::nullopt, app.help(), 0};
  } catch (const CLI::CallForVersion& e) {
    return {std::nullopt, std::string(kVersion) + "\n", 0};
  } catch (const CLI::ParseError& e) {
    throw ConfigError(e.what());
  }

  o.command = app.remaining();
  if (o.command.empty()) throw ConfigError("missing PROGRAM: usage: fsdprun [options] PROGRAM [ARGS...]");
  if (o.command.front().starts_with("-")) {
    throw ConfigError("unknown flag '" + o.command.front() + "' (see fsdprun --help)");
  }

  std::tie(o.minNodes, o.maxNodes) = parseNnodes(nnodes);
  const int cpus = std::max(1u, std::thread::hardware_concurrency());
  o.nprocPerNode = parseNprocPerNode(nproc, cpus, 0);
  const auto restarts = parseInt(maxRestarts);
  if (!restarts || *restarts < 0 || *restarts > 1'000'000) {
    throw ConfigError("--max_restarts '" + maxRestarts + "': expected a non-negative integer");
  }
  o.maxRestarts = static_cast<int>(*restarts);
  const auto interval = parseDouble(monitorInterval);
  if (!interval || *interval <= 0) {
    throw ConfigError("--monitor_interval '" + monitorInterval + "': expected a positive number of seconds");
  }
  o.monitorInterval = *interval;
  const auto timeout = parseDouble(shutdownTimeout);
  if (!timeout || *timeout < 0) {
    throw ConfigError("--shutdown_timeout '" + shutdownTimeout +
                      "': expected a non-negative number of seconds");
  }
  o.shutdownTimeout = std::chrono::milliseconds(static_cast<long long>(*timeout * 1000));
  if (!masterPort.empty()) {
    const auto port = parseInt(masterPort);
    if (!port || *port < 1 || *port > 65535) {
      throw ConfigError("--master_port '" + masterPort + "': expected a port number 1-65535");
    }
    o.masterPort = static_cast<int>(*port);
  }
  if (o.rdzvBackend != "static" && o.rdzvBackend != "c10d") {
    throw ConfigError("--rdzv_backend '" + o.rdzvBackend + "': expected 'c10d' or 'static'");
  }
  return {o, "", 0};
}

std::vector<std::string> workerCommand(const LaunchOptions& options, const EnvLookup& env) {
  const std::string& program = options.command.front();
  const bool python = !options.noPython && (options.module || program.ends_with(".py"));
  std::vector<std::string> argv;
  if (python) {
    const std::string exec = env("PYTHON_EXEC").value_or("python3");
    std::string why;
    const auto interpreter = findExecutable(exec, &why);
    if (!interpreter) throw ConfigError("PYTHON_EXEC '" + exec + "': " + why);
    argv = {*interpreter, "-u"};
    if (options.module) {
      argv.push_back("-m");
    } else {
      if (::access(program.c_str(), R_OK) != 0) {
        throw ConfigError("PROGRAM '" + program + "': no readable Python script at that path");
      }
    }
    argv.insert(argv.end(), options.command.begin(), options.command.end());
    return argv;
  }
  std::string why;
  const auto resolved = findExecutable(program, &why);
  if (!resolved) {
    throw ConfigError("PROGRAM '" + program + "': " + why + " (expected an executable file)");
  }
  argv = options.command;
  argv.front() = *resolved;
  return argv;
}

}  // namespace fsdp::launcher
