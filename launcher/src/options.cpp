#include "fsdp/launcher/options.hpp"

#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstring>
#include <filesystem>
#include <memory>
#include <thread>

#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/launcher/snapshot_keeper.hpp"
#include "fsdp/slurm/slurm_env.hpp"

namespace fsdp::launcher {
namespace {

constexpr const char* kVersion = "fsdprun 0.1.0";

std::optional<int> positiveInt(const std::string& value) {
  const auto n = parseInt(value);
  if (!n || *n < 1 || *n > 1'000'000) return std::nullopt;
  return static_cast<int>(*n);
}

bool truthy(const std::string& value) {
  return value == "1" || value == "true" || value == "True" || value == "TRUE" || value == "yes";
}

// One option: its flag names, its PET_ variable and where its text lands before conversion.
struct Spec {
  const char* key;    // the name in `sources` and in messages ("nproc_per_node")
  const char* names;  // CLI11 names: "--nproc_per_node,--nproc-per-node"
  const char* help;
  const char* group;
  bool isFlag = false;
};

constexpr const char* kWorkers = "Worker/node size";
constexpr const char* kRdzv = "Rendezvous";
constexpr const char* kLaunch = "User-code launch";
constexpr const char* kLogs = "Logging";

const Spec kSpecs[] = {
    {"nnodes", "--nnodes", "Number of nodes, N or MIN:MAX (elastic)", kWorkers},
    {"nproc_per_node", "--nproc_per_node,--nproc-per-node",
     "Workers per node: N, auto (GPUs, else CPUs), cpu or gpu", kWorkers},
    {"node_rank", "--node_rank,--node-rank", "Rank of this node (static rendezvous)", kWorkers},
    {"standalone", "--standalone",
     "Single-node job: an embedded rendezvous on a free loopback port", kRdzv, true},
    {"rdzv_backend", "--rdzv_backend,--rdzv-backend", "Rendezvous backend: c10d or static", kRdzv},
    {"rdzv_endpoint", "--rdzv_endpoint,--rdzv-endpoint",
     "HOST[:PORT] of the rendezvous server ([IPv6]:PORT); default port 29400", kRdzv},
    {"rdzv_id", "--rdzv_id,--rdzv-id", "Job id, the same on every node", kRdzv},
    {"rdzv_conf", "--rdzv_conf,--rdzv-conf",
     "KEY=VALUE,... : join_timeout, last_call_timeout, close_timeout, heartbeat_interval, "
     "heartbeat_timeout (seconds), is_host, token_file, allow_pytorch_clients",
     kRdzv},
    {"master_addr", "--master_addr,--master-addr",
     "Rendezvous host of the static backend (node 0's address)", kRdzv},
    {"master_port", "--master_port,--master-port",
     "Rendezvous port of the static backend; with --standalone, MASTER_PORT for the workers", kRdzv},
    {"local_addr", "--local_addr,--local-addr",
     "Address of this node for the other nodes (default: the one facing the rendezvous server)",
     kRdzv},
    {"max_restarts", "--max_restarts,--max-restarts",
     "Restarts of the worker group after failures before giving up", kLaunch},
    {"hang_timeout", "--hang_timeout,--hang-timeout",
     "Seconds without a completed collective or progress mark on any rank before the job counts "
     "as hung (libfsdp programs): the agents report who is stuck where, with stacks, and restart. "
     "'auto' (default): 10 times the longest interval between progress marks, at least 60 s, and "
     "180 s before the second mark; before the first mark at least 180 s either way; 0 turns the "
     "watchdog off",
     kLaunch},
    {"max_stalled_restarts", "--max_stalled_restarts,--max-stalled-restarts",
     "Give up after this many restarts in a row in which no step completed (libfsdp programs; "
     "default 3; 0 = never)",
     kLaunch},
    {"monitor_interval", "--monitor_interval,--monitor-interval",
     "Accepted for torchrun compatibility; fsdprun reacts to worker exits at once", kLaunch},
    {"role", "--role", "Role name of the workers (ROLE_NAME)", kLaunch},
    {"no_python", "--no_python,--no-python", "Execute PROGRAM directly, even when it ends in .py",
     kLaunch, true},
    {"module", "-m,--module", "PROGRAM is a Python module (python3 -m)", kLaunch, true},
    {"run_path", "--run_path,--run-path", "PROGRAM is a Python script whatever its name", kLaunch,
     true},
    {"event_log_handler", "--event_log_handler,--event-log-handler",
     "Accepted for torchrun compatibility (its event-handler plugins) and ignored with a warning: "
     "fsdprun's events are its log lines, the JSONL metrics and --metrics_port",
     kLaunch},
    {"numa_binding", "--numa_binding,--numa-binding",
     "Bind each local worker to CPUs: node (a NUMA node's), socket (a package's), exclusive (an "
     "even share of the allowed CPUs, no two workers sharing one), core-complex (CPUs sharing one "
     "L3 cache); workers spread over the nodes, sockets or complexes by local rank",
     kLaunch},
    {"start_method", "--start_method,--start-method",
     "Accepted for torchrun compatibility (spawn, fork, forkserver); workers are always exec'd",
     kLaunch},
    {"signals_to_handle", "--signals_to_handle,--signals-to-handle",
     "Signals forwarded to the workers (default SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2); "
     "TERM/INT/HUP/QUIT also stop the job",
     kLaunch},
    {"shutdown_timeout", "--shutdown_timeout,--shutdown-timeout",
     "Seconds between the stop signal and SIGKILL", kLaunch},
    {"snapshot_memory_limit", "--snapshot_memory_limit,--snapshot-memory-limit",
     "Memory this node may hold in in-memory snapshots of its workers and its peer's (512M, 4G; "
     "0 = no snapshots; default: a quarter of the RAM). Kept only with --max_restarts > 0",
     kLaunch},
    {"restart_mode", "--restart_mode,--restart-mode",
     "How workers recover from a failure elsewhere: auto (default): a worker of a libfsdp program "
     "that is training re-forms in process (its communicators rebuilt, its state from its own "
     "snapshot) and only the failed worker starts again; process: every worker starts again",
     kLaunch},
    {"standby", "--standby",
     "Keep a spare of each worker waiting in fsdp::init() (libfsdp programs), so that a restart "
     "skips the program's start-up. Needs --max_restarts > 0",
     kLaunch, true},
    {"metrics_port", "--metrics_port,--metrics-port",
     "Serve Prometheus metrics at http://ADDR:PORT/metrics (read-only): each worker's step, step "
     "time split, throughput, loss, memory, straggler score; the node's restarts and rounds; the "
     "rendezvous server's where this agent serves it. 0: a free port (logged). Default: off",
     kLaunch},
    {"metrics_addr", "--metrics_addr,--metrics-addr",
     "Address the metrics endpoint binds (default 0.0.0.0: every interface)", kLaunch},
    {"no_slurm", "--no_slurm,--no-slurm", "Ignore the SLURM_* environment", kLaunch, true},
    {"dry_run", "--dry_run,--dry-run",
     "Print the resolved configuration, with where each value came from, and exit", kLaunch, true},
    {"log_dir", "--log_dir,--log-dir",
     "Worker logs under LOG_DIR/<run_id>/attempt_<k>/<local_rank>/{stdout,stderr}.log", kLogs},
    {"redirects", "-r,--redirects",
     "Send worker stdout (1), stderr (2) or both (3) to log files only; N or LOCAL_RANK:N,...",
     kLogs},
    {"tee", "-t,--tee",
     "Copy worker stdout (1), stderr (2) or both (3) to log files and the console, prefixed "
     "[rank<N>]:",
     kLogs},
    {"logs_specs", "--logs_specs,--logs-specs",
     "Accepted for torchrun compatibility (a LogsSpecs plugin class) and ignored with a warning: "
     "--log_dir, --redirects and --tee say where worker logs go",
     kLogs},
    {"local_ranks_filter", "--local_ranks_filter,--local-ranks-filter",
     "Only these local ranks' output reaches the console (e.g. 0 or 0,1)", kLogs},
};

std::string petName(const std::string& key) {
  std::string name = "PET_";
  for (char c : key) name += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return name;
}

std::vector<int> parseSignals(const std::string& text) {
  std::vector<int> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const auto end = std::min(text.find(',', start), text.size());
    const std::string name = text.substr(start, end - start);
    start = end + 1;
    const auto sig = parseSignal(name);
    if (!sig || *sig == SIGKILL || *sig == SIGSTOP || *sig == SIGCHLD) {
      throw ConfigError("--signals_to_handle '" + text + "': '" + name +
                        "' is not a signal fsdprun can handle (e.g. SIGTERM,SIGUSR1)");
    }
    out.push_back(*sig);
  }
  return out;
}

// Fills the settings the user left out (source "default") from a Slurm job: node count, the
// rendezvous endpoint (first host, port derived from the job id), run id, preferred node rank.
// Returns whether the endpoint came from Slurm.
bool applySlurm(const slurm::SlurmJob& job, std::map<std::string, std::string>& text,
                std::map<std::string, std::string>& sources) {
  slurm::checkOneTaskPerNode(job);
  const auto given = [&sources](const char* key) { return sources.at(key) != "default"; };
  const auto take = [&](const char* key, const std::string& value, const std::string& source) {
    text[key] = value;
    sources[key] = "Slurm " + source;
  };
  if (!given("nnodes")) {
    slurm::checkInsideStep(job);
    take("nnodes", std::to_string(job.numNodes.value), job.numNodes.source);
  }
  bool endpoint = false;
  const bool multiNode = parseNnodes(text["nnodes"]).second > 1;
  if (multiNode && !given("rdzv_endpoint") && !given("master_addr") && !given("standalone")) {
    take("rdzv_endpoint", job.headNode.value + ":" + std::to_string(job.rdzvPort.value),
         job.headNode.source + ", port " + job.rdzvPort.source);
    if (!given("rdzv_backend")) take("rdzv_backend", "c10d", "job");
    endpoint = true;
  }
  if (!given("rdzv_id")) take("rdzv_id", job.rdzvId.value, job.rdzvId.source);
  if (!given("node_rank") && job.nodeId && multiNode) {
    take("node_rank", std::to_string(job.nodeId->value), job.nodeId->source);
  }
  return endpoint;
}

}  // namespace

std::vector<int> defaultSignalsToHandle() {
  return {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};
}

bool isStopSignal(int sig) {
  return sig == SIGTERM || sig == SIGINT || sig == SIGHUP || sig == SIGQUIT;
}

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

int countGpus(const EnvLookup& env) {
  if (const auto visible = env("CUDA_VISIBLE_DEVICES")) {
    if (visible->empty() || *visible == "-1" || *visible == "NoDevFiles") return 0;
    return static_cast<int>(std::count(visible->begin(), visible->end(), ',')) + 1;
  }
  int count = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 6 && name.starts_with("nvidia") &&
        std::all_of(name.begin() + 6, name.end(), [](unsigned char c) { return std::isdigit(c); })) {
      ++count;
    }
  }
  return count;
}

ParseResult parseCommandLine(int argc, const char* const* argv, const EnvLookup& env) {
  CLI::App app{"fsdprun: launch a (fully sharded) data-parallel training job on this node, on "
               "several nodes, or under Slurm.\nUsage: fsdprun [options] PROGRAM [ARGS...]",
               "fsdprun"};
  app.prefix_command();
  app.set_version_flag("--version", kVersion);
  app.get_formatter()->column_width(42);

  std::map<std::string, std::string> text = {
      {"nnodes", "1"},          {"nproc_per_node", "1"},   {"rdzv_backend", "static"},
      {"rdzv_id", "none"},      {"max_restarts", "0"},     {"monitor_interval", "0.1"},
      {"role", "default"},      {"master_addr", "127.0.0.1"}, {"start_method", "spawn"},
      {"shutdown_timeout", "30"},   {"snapshot_memory_limit", "auto"},
      {"hang_timeout", "auto"},     {"max_stalled_restarts", "3"},
      {"metrics_addr", "0.0.0.0"},
  };
  std::map<std::string, bool> flags;
  std::map<std::string, CLI::Option*> cli;
  LaunchOptions o;
  for (const Spec& spec : kSpecs) {
    if (spec.isFlag) {
      bool& target = flags[spec.key];
      cli[spec.key] = app.add_flag(spec.names, target, spec.help)->group(spec.group);
    } else {
      std::string& target = text[spec.key];
      cli[spec.key] = app.add_option(spec.names, target, spec.help)->group(spec.group);
    }
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    return {std::nullopt, app.help(), 0};
  } catch (const CLI::CallForVersion&) {
    return {std::nullopt, std::string(kVersion) + "\n", 0};
  } catch (const CLI::ParseError& e) {
    throw ConfigError(e.what());
  }

  // Sources, and PET_<NAME> fallbacks for what the command line left out (as torchrun).
  for (const Spec& spec : kSpecs) {
    const std::string key = spec.key;
    if (cli[key]->count() > 0) {
      o.sources[key] = "flag";
      continue;
    }
    const std::string pet = petName(key);
    if (const auto value = env(pet)) {
      o.sources[key] = "environment " + pet;
      if (spec.isFlag) {
        flags[key] = truthy(*value);
      } else {
        text[key] = *value;
      }
    } else {
      o.sources[key] = "default";
    }
  }

  o.command = app.remaining();
  if (o.command.empty()) {
    throw ConfigError("missing PROGRAM: usage: fsdprun [options] PROGRAM [ARGS...]");
  }
  if (o.command.front().starts_with("-")) {
    throw ConfigError("unknown flag '" + o.command.front() + "' (see fsdprun --help)");
  }

  o.standalone = flags["standalone"];
  o.noPython = flags["no_python"];
  o.module = flags["module"];
  o.runPath = flags["run_path"];
  o.noSlurm = flags["no_slurm"];
  o.dryRun = flags["dry_run"];
  o.standby = flags["standby"];

  // Under Slurm, what the user left out comes from the job (see applySlurm).
  std::optional<slurm::SlurmJob> job;
  if (!o.noSlurm) job = slurm::readSlurmJob(env);
  bool endpointFromSlurm = false;
  if (job) endpointFromSlurm = applySlurm(*job, text, o.sources);

  std::tie(o.minNodes, o.maxNodes) = parseNnodes(text["nnodes"]);
  const int cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const std::string nproc = text["nproc_per_node"];
  const auto slurmNproc = !job                 ? std::nullopt
                          : nproc == "auto"    ? slurm::autoNprocPerNode(*job)
                          : nproc == "gpu"     ? job->gpusOnNode
                          : nproc == "cpu"     ? job->cpusOnNode
                                               : std::nullopt;
  if (slurmNproc && slurmNproc->value > 0) {
    o.nprocPerNode = slurmNproc->value;
    o.sources["nproc_per_node"] += ": " + nproc + ", from Slurm " + slurmNproc->source;
  } else {
    o.nprocPerNode = parseNprocPerNode(nproc, cpus,
                                       nproc == "auto" || nproc == "gpu" ? countGpus(env) : 0);
  }
  const bool slurmRank = o.sources.count("node_rank") > 0 && o.sources.at("node_rank").starts_with("Slurm");
  if (const auto rank = parseInt(text["node_rank"]); slurmRank && rank && *rank >= o.maxNodes) {
    // Slurm gave more nodes than --nnodes asks for: this one waits as a spare (no preferred rank).
    o.sources["node_rank"] += " (beyond --nnodes " + text["nnodes"] + ": a spare node)";
  } else if (!text["node_rank"].empty()) {
    if (!rank || *rank < 0 || *rank >= o.maxNodes) {
      throw ConfigError("--node_rank '" + text["node_rank"] + "': expected 0 to " +
                        std::to_string(o.maxNodes - 1) + " (--nnodes is " + text["nnodes"] + ")");
    }
    o.nodeRank = static_cast<int>(*rank);
  }
  const auto restarts = parseInt(text["max_restarts"]);
  if (!restarts || *restarts < 0 || *restarts > 1'000'000) {
    throw ConfigError("--max_restarts '" + text["max_restarts"] +
                      "': expected a non-negative integer");
  }
  o.maxRestarts = static_cast<int>(*restarts);
  const auto interval = parseDouble(text["monitor_interval"]);
  if (!interval || *interval <= 0) {
    throw ConfigError("--monitor_interval '" + text["monitor_interval"] +
                      "': expected a positive number of seconds");
  }
  o.monitorInterval = *interval;
  if (text["hang_timeout"] != "auto") {
    const auto hang = parseDouble(text["hang_timeout"]);
    if (!hang || !(*hang >= 0) || *hang > 1e6) {
      throw ConfigError("--hang_timeout '" + text["hang_timeout"] +
                        "': expected 'auto', 0 (off) or a positive number of seconds");
    }
    o.hangTimeout = std::chrono::milliseconds(static_cast<long long>(*hang * 1000));
  }
  if (!text["metrics_port"].empty()) {
    const auto port = parseInt(text["metrics_port"]);
    if (!port || *port < 0 || *port > 65535) {
      throw ConfigError("--metrics_port '" + text["metrics_port"] +
                        "': expected a TCP port, 0 to 65535 (0: a free one)");
    }
    o.metricsPort = static_cast<int>(*port);
  }
  o.metricsAddr = text["metrics_addr"];
  if (o.metricsAddr.empty()) throw ConfigError("--metrics_addr '': expected an address to bind, e.g. 0.0.0.0");
  const auto stalled = parseInt(text["max_stalled_restarts"]);
  if (!stalled || *stalled < 0 || *stalled > 1'000'000) {
    throw ConfigError("--max_stalled_restarts '" + text["max_stalled_restarts"] +
                      "': expected a non-negative integer");
  }
  o.maxStalledRestarts = static_cast<int>(*stalled);
  const auto timeout = parseDouble(text["shutdown_timeout"]);
  if (!timeout || *timeout < 0 || *timeout > 1e6) {
    throw ConfigError("--shutdown_timeout '" + text["shutdown_timeout"] +
                      "': expected a non-negative number of seconds");
  }
  o.shutdownTimeout = std::chrono::milliseconds(static_cast<long long>(*timeout * 1000));
  if (text["snapshot_memory_limit"] == "auto") {
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    const long pageBytes = ::sysconf(_SC_PAGESIZE);
    o.snapshotMemoryLimit = pages > 0 && pageBytes > 0
                                ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(pageBytes) / 4
                                : std::uint64_t{1} << 30;
  } else {
    o.snapshotMemoryLimit = parseByteSize(text["snapshot_memory_limit"], "--snapshot_memory_limit");
  }
  if (!text["master_port"].empty()) {
    const auto port = parseInt(text["master_port"]);
    if (!port || *port < 1 || *port > 65535) {
      throw ConfigError("--master_port '" + text["master_port"] + "': expected a port number 1-65535");
    }
    o.masterPort = static_cast<int>(*port);
  }
  o.rdzvBackend = text["rdzv_backend"];
  if (o.rdzvBackend != "static" && o.rdzvBackend != "c10d") {
    throw ConfigError("--rdzv_backend '" + o.rdzvBackend + "': expected 'c10d' or 'static'");
  }
  o.rdzvEndpoint = text["rdzv_endpoint"];
  o.rdzvId = text["rdzv_id"];
  if (o.rdzvId.empty() || o.rdzvId.size() > 255) {
    throw ConfigError("--rdzv_id '" + o.rdzvId + "': expected 1-255 characters");
  }
  o.rdzvConf = RdzvConf::parse(text["rdzv_conf"]);
  for (const auto& item : o.rdzvConf.ignored) o.warnings.push_back("--rdzv_conf " + item + ": ignored");
  if (!text["event_log_handler"].empty()) {
    o.warnings.push_back("--event_log_handler '" + text["event_log_handler"] +
                         "': ignored (torchrun's event-handler plugins; fsdprun's events are its log lines, the "
                         "JSONL metrics and --metrics_port)");
  }
  if (!text["logs_specs"].empty()) {
    o.warnings.push_back("--logs_specs '" + text["logs_specs"] +
                         "': ignored (a torchrun LogsSpecs plugin class; --log_dir, --redirects and --tee say "
                         "where worker logs go)");
  }
  if (const auto& mode = text["restart_mode"]; !mode.empty()) {
    if (mode != "auto" && mode != "process") {
      throw ConfigError("--restart_mode '" + mode + "': expected auto or process");
    }
    o.restartMode = mode;
  }
  if (const auto& numa = text["numa_binding"]; !numa.empty()) {
    if (numa != "node" && numa != "socket" && numa != "exclusive" && numa != "core-complex") {
      throw ConfigError("--numa_binding '" + numa + "': expected node, socket, exclusive or core-complex");
    }
    o.numaBinding = numa;
  }
  // The node Slurm numbers 0 is the first host of the node list: it serves the rendezvous
  // (host names inside a job are not always this machine's gethostname()).
  if (endpointFromSlurm && !o.rdzvConf.isHost && job->nodeId) {
    o.rdzvConf.isHost = job->nodeId->value == 0;
  }
  o.role = text["role"];
  if (o.role.empty()) throw ConfigError("--role '': expected a name");
  o.masterAddr = text["master_addr"];
  if (o.masterAddr.empty()) throw ConfigError("--master_addr '': expected a host");
  o.localAddr = text["local_addr"];
  o.logDir = text["log_dir"];
  o.redirects = StreamSpec::parse(text["redirects"], "--redirects");
  o.tee = StreamSpec::parse(text["tee"], "--tee");
  if (!text["local_ranks_filter"].empty()) {
    o.localRanksFilter = parseLocalRanksFilter(text["local_ranks_filter"]);
  }
  o.startMethod = text["start_method"];
  if (o.startMethod != "spawn" && o.startMethod != "fork" && o.startMethod != "forkserver") {
    throw ConfigError("--start_method '" + o.startMethod +
                      "': expected spawn, fork or forkserver");
  }
  o.signalsToHandle = text["signals_to_handle"].empty() ? defaultSignalsToHandle()
                                                        : parseSignals(text["signals_to_handle"]);
  if (o.standalone && o.maxNodes > 1) {
    throw ConfigError("--standalone with --nnodes " + text["nnodes"] +
                      ": a standalone job has one node; leave out --standalone and give "
                      "--rdzv_endpoint for several");
  }
  if (o.noPython && o.module) {
    throw ConfigError("--no_python and --module: a module needs the Python interpreter");
  }
  if (o.standby && o.maxRestarts == 0) {
    throw ConfigError("--standby with --max_restarts 0: standby workers replace restarted ones; "
                      "give --max_restarts N (N > 0)");
  }
  return {o, "", 0};
}

}  // namespace fsdp::launcher
