// recovery: what a failure costs a training job. A worker (or a whole agent, its worker with
// it) is SIGKILLed by pid at a random moment of a random step; rank 0's metrics file (a line
// per step with its unix time, and a resume line once the state is restored) gives the steps
// redone and the seconds from the kill to the state restored, to the first step completed
// after it, and to the first step beyond what had been done before the kill. fsdprun resumes
// from its in-memory snapshots (this node's, or the peer copy of a lost node's); the peer,
// torchrun + DDP on Gloo (bench/peer/recovery_torch.py), from the newest torch.save
// checkpoint. Also the per-step cost of the snapshots: the same job without a kill,
// --snapshot_every 1 vs 0, in the same invocation. And jobs of more nodes (agents of one
// worker on 127.0.0.2, .3, ...): the agent that serves the rendezvous lost (its successor takes
// the rendezvous over), a node lost with a spare agent waiting (the world keeps its size), a
// node of four lost without one (three go on).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <utility>

#include "bench.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"
#include "recovery_job.hpp"

namespace fsdp::bench {
namespace {

namespace fs = std::filesystem;
using namespace recovery_job;

constexpr int kMaxRestarts = 3;

// ---- the two systems -----------------------------------------------------------------------

struct Config {
  long long steps = 24;
  long long batch = 32;  // deep's global batch (the gpt config is fixed, below)
  std::string torchrun;  // path of torchrun_fixed
  bool peer = true;
  bool standby = true;  // fsdprun --standby: spare workers wait in fsdp::init() for a restart
  // --restart_mode of each fsdprun run, on the same kills: auto (survivors re-form in process)
  // and process (every worker starts again).
  std::vector<std::string> restartModes = {"auto", "process"};
};

// The training program of `model` under fsdprun: a train line per step in `metrics`.
std::vector<std::string> trainer(const std::string& model, const Config& c,
                                 const std::string& metrics, int snapshotEvery) {
  const std::string bin = binDir();
  std::vector<std::string> argv;
  if (model == "deep") {
    argv = {bin + "/mnist", "--model", "deep", "--no_dropout", "--no_eval", "--progress", "none"};
    argv.insert(argv.end(), {"--batch_size", std::to_string(c.batch)});
  } else {
    // minGPT-style, small enough for a step well under a second on 2 cores.
    argv = {bin + "/gpt", "--n_layer", "4", "--n_head", "4", "--n_embd", "128"};
    argv.insert(argv.end(), {"--block_size", "64", "--batch_size", "16", "--eval_every", "0"});
    argv.insert(argv.end(), {"--eval_batches", "1", "--sample_chars", "0"});
  }
  argv.insert(argv.end(),
              {"--max_steps", std::to_string(c.steps), "--log_every", "1", "--metrics_file",
               metrics, "--snapshot_every", std::to_string(snapshotEvery)});
  return argv;
}

// Unique per job: the workers to kill and the leftovers to clean are found by it.
std::string newRunId() {
  const auto ns = std::chrono::steady_clock::now().time_since_epoch().count();
  return "recovery-" + std::to_string(::getpid()) + "-" + std::to_string(ns);
}

// Detection of a lost node within seconds in the jobs of more than two nodes (as the node-loss
// tests have it), rather than the 5 s heartbeat timeout of the default.
const std::string kQuickRdzv = "heartbeat_interval=0.2,heartbeat_timeout=2,last_call_timeout=1";

struct Layout {
  std::string name;  // "2x1": one agent of 2 workers; "1x2 agents": 2 agents of 1; ...
  int agents;
  int workersPerAgent;
  std::string nnodes = "";    // of a multi-agent job: N or MIN:MAX
  std::string rdzvConf = "";  // --rdzv_conf besides is_host
  bool agentHosts = false;    // agent 0 serves the rendezvous (is_host=true), no fsdprun-rdzv
  // Ranks of the first round: at most MAX nodes hold workers (the others wait as spares).
  int worldSize() const {
    const auto colon = nnodes.find(':');
    const int maxNodes = nnodes.empty()               ? agents
                         : colon == std::string::npos ? std::stoi(nnodes)
                                                      : std::stoi(nnodes.substr(colon + 1));
    return std::min(agents, maxNodes) * workersPerAgent;
  }
};

// fsdprun, one job: the metrics lines and when the kill was.
Observed runOurs(const std::string& model, const Config& c, const Layout& layout, Kill kill,
                 int snapshotEvery, KillAt at, const std::string& mode = "process") {
  RunDir dir;
  Launch launch{.runId = newRunId(), .metricsFile = dir.path() + "/metrics.jsonl"};
  launch.env = jobEnvironment(launch.runId);
  const auto worker = trainer(model, c, launch.metricsFile, snapshotEvery);
  const std::string fsdprun = binDir() + "/fsdprun";
  // More processes than cores from three agents on: their steps are slower.
  const auto limit = std::chrono::seconds(120 + 2 * c.steps * std::max(2, layout.agents));
  // A job that failed, did not resume after its kill, or (auto) restarted a survivor, leaves its
  // folder to be read.
  const auto run = [&] {
    Observed seen = runJob(launch, dir, kill, at, limit);
    const double killTime = seen.killUnixTime.value_or(0);
    const bool resumed = std::any_of(seen.lines.begin(), seen.lines.end(), [&](const auto& l) {
      return l.value("type", "") == "resume" && l.value("unix_time", 0.0) > killTime;
    });
    // In auto mode, a survivor that did not keep its process: the agents' logs say why.
    const bool survivorRestarted =
        mode == "auto" && seen.ranksStillRunning &&
        std::any_of(seen.pidsAtKill.begin(), seen.pidsAtKill.end(), [&](const auto& rankPid) {
          return rankPid.first != at.rank && !seen.ranksStillRunning->contains(rankPid.first);
        });
    if (!seen.finished || (seen.killUnixTime && !resumed) || survivorRestarted) {
      dir.keep();
      seen.logDir = dir.path();
    }
    return seen;
  };
  std::vector<std::string> common = {"--max_restarts", std::to_string(kMaxRestarts), "--rdzv_id",
                                     launch.runId, "--restart_mode", mode};
  // The spares: in process mode every worker's, in auto mode the failed worker's takes its place.
  if (c.standby) common.push_back("--standby");
  if (layout.agents == 1) {
    std::vector<std::string> argv = {fsdprun, "--standalone", "--nproc_per_node",
                                     std::to_string(layout.workersPerAgent)};
    argv.insert(argv.end(), common.begin(), common.end());
    argv.insert(argv.end(), worker.begin(), worker.end());
    launch.agents.push_back(argv);
    return run();
  }
  // The endpoint: agent 0's address when it serves the rendezvous, else a daemon's, outside
  // every agent.
  std::optional<RdzvServer> server;
  if (!layout.agentHosts) server.emplace(dir.path() + "/rdzv.err");
  const std::string endpoint = layout.agentHosts ? "127.0.0.2:" + std::to_string(freePort())
                                                 : "127.0.0.1:" + std::to_string(server->port());
  const std::string conf = layout.rdzvConf.empty() ? "" : "," + layout.rdzvConf;
  for (int a = 0; a < layout.agents; ++a) {
    const bool host = layout.agentHosts && a == 0;
    std::vector<std::string> argv = {fsdprun, "--nnodes", layout.nnodes, "--nproc_per_node",
                                     std::to_string(layout.workersPerAgent)};
    argv.insert(argv.end(), {"--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_conf",
                             (host ? "is_host=true" : "is_host=false") + conf});
    argv.insert(argv.end(), {"--local_addr", "127.0.0." + std::to_string(a + 2)});
    argv.insert(argv.end(), common.begin(), common.end());
    argv.insert(argv.end(), worker.begin(), worker.end());
    launch.agents.push_back(argv);
  }
  return run();
}

// torchrun (1 node, 2 workers, --max_restarts 3) running recovery_torch.py.
Observed runPeer(const Config& c, int checkpointEvery, KillAt at) {
  RunDir dir;
  Launch launch{.runId = newRunId(), .metricsFile = dir.path() + "/metrics.jsonl"};
  launch.env = jobEnvironment(launch.runId);
  fs::create_directories(dir.path() + "/ckpt");
  // The c10d backend on a free port rather than --standalone, which replaces --rdzv_id.
  std::vector<std::string> argv = {"/usr/bin/python3", c.torchrun, "--monitor_interval", "0.1",
                                   "--nnodes",         "1",        "--nproc_per_node",   "2"};
  argv.insert(argv.end(), {"--max_restarts", std::to_string(kMaxRestarts), "--rdzv_backend", "c10d",
                           "--rdzv_endpoint", "127.0.0.1:" + std::to_string(freePort()),
                           "--rdzv_id", launch.runId});
  argv.insert(argv.end(),
              {std::string(FSDP_SOURCE_DIR) + "/bench/peer/recovery_torch.py", "--model", "deep",
               "--steps", std::to_string(c.steps), "--batch_size", std::to_string(c.batch)});
  argv.insert(argv.end(),
              {"--checkpoint_every", std::to_string(checkpointEvery), "--checkpoint_dir",
               dir.path() + "/ckpt", "--metrics_file", launch.metricsFile});
  launch.agents.push_back(argv);
  return runJob(launch, dir, Kill::kWorker, at, std::chrono::seconds(180 + 6 * c.steps));
}

// fsdprun (1 node, 2 workers, --max_restarts 3) running the same script with fsdprun's Python
// module: restore() on a start, snapshot() every `snapshotEvery` steps (0: none), no torch.save.
Observed runPythonModule(const Config& c, int snapshotEvery, Kill kill, KillAt at) {
  RunDir dir;
  Launch launch{.runId = newRunId(), .metricsFile = dir.path() + "/metrics.jsonl"};
  launch.env = jobEnvironment(launch.runId);
  launch.env.push_back("PYTHON_EXEC=/usr/bin/python3");
  fs::create_directories(dir.path() + "/ckpt");
  launch.agents.push_back({binDir() + "/fsdprun", "--nproc_per_node", "2", "--max_restarts",
                           std::to_string(kMaxRestarts), "--rdzv_id", launch.runId,
                           std::string(FSDP_SOURCE_DIR) + "/bench/peer/recovery_torch.py", "--model", "deep",
                           "--steps", std::to_string(c.steps), "--batch_size", std::to_string(c.batch),
                           "--checkpoint_every", "0", "--checkpoint_dir", dir.path() + "/ckpt",
                           "--metrics_file", launch.metricsFile, "--fsdprun_snapshot_every",
                           std::to_string(snapshotEvery)});
  return runJob(launch, dir, kill, at, std::chrono::seconds(180 + 6 * c.steps));
}

// One job, its failure to start (a binary being rebuilt, no free port) reported like any other.
template <typename Fn>
Observed attempt(Fn&& run) {
  try {
    return run();
  } catch (const Error& e) {
    return Observed{.error = e.what()};
  }
}

std::vector<std::string> splitList(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream list(text);
  for (std::string item; std::getline(list, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// process / auto of two recovery overheads; none where auto's is not above zero (the first new
// step came within one median step of the kill: the difference is the steps' noise, and a ratio
// of it means nothing).
nlohmann::json overheadRatio(double process, double autoMode) {
  if (autoMode <= 0) {
    return {{"ratio", nullptr},
            {"note", "auto's overhead is not above zero: within one step's noise, no ratio"}};
  }
  return {{"ratio", process / autoMode}};
}

}  // namespace

void recovery(const Args& args) {
  Config c;
  c.steps = args.ints("steps", "24").front();
  c.batch = args.ints("batch_size", "32").front();
  if (c.steps < 15)
    throw ConfigError("--steps '" + std::to_string(c.steps) + "': expected 15 or more");
  const int reps = static_cast<int>(args.ints("reps", "1").front());
  const auto seedText = args.str("seed", "");
  const std::uint64_t seed = seedText.empty()
                                 ? std::random_device{}()
                                 : static_cast<std::uint64_t>(args.ints("seed", "1").front());
  const auto models = splitList(args.str("models", "deep,gpt"));
  for (const auto& m : models) {
    if (m != "deep" && m != "gpt")
      throw ConfigError("--models '" + args.str("models", "") + "': expected deep and/or gpt");
  }
  // host, spare and shrink4 (3 to 5 agents, 1 worker each) only when named: on 2 cores each
  // costs minutes.
  const auto cases = splitList(args.str("cases", "worker,agents_worker,agent,overhead"));
  const std::set<std::string> known = {"worker", "agents_worker", "agent", "overhead",
                                       "host",   "spare",         "shrink4"};
  for (const auto& k : cases) {
    if (!known.contains(k)) {
      throw ConfigError("--cases '" + args.str("cases", "") +
                        "': expected worker, agents_worker, agent, overhead, host, spare and/or "
                        "shrink4");
    }
  }
  const auto torchrunFlag = args.str("torchrun", "1");
  if (torchrunFlag != "0" && torchrunFlag != "1")
    throw ConfigError("--torchrun '" + torchrunFlag + "': expected 0 or 1");
  const auto checkpointEvery = args.ints("checkpoint_every", "10,50");
  c.torchrun = std::string(FSDP_SOURCE_DIR) + "/../shared/peer-torchrun/torchrun_fixed";
  c.peer = torchrunFlag == "1";
  const auto standbyFlag = args.str("standby", "1");
  if (standbyFlag != "0" && standbyFlag != "1") {
    throw ConfigError("--standby '" + standbyFlag + "': expected 0 or 1");
  }
  c.standby = standbyFlag == "1";
  c.restartModes = splitList(args.str("restart_modes", "auto,process"));
  for (const auto& m : c.restartModes) {
    if (m != "auto" && m != "process") {
      throw ConfigError("--restart_modes '" + args.str("restart_modes", "") + "': expected auto and/or process");
    }
  }
  if (c.restartModes.empty()) throw ConfigError("--restart_modes '': expected auto and/or process");

  std::mt19937_64 rng(seed);
  // The kill step: one per model and rep, the same for every case and both systems, drawn past
  // the warm-up and early enough to leave steps to come back to. The moment within the next
  // step: drawn per run.
  const auto drawStep = [&] {
    const long long lo = std::max<long long>(kWarmupSteps + 2, c.steps / 5);
    const long long hi = std::max(lo, c.steps - std::max<long long>(6, c.steps / 4));
    return std::uniform_int_distribution<long long>(lo, hi)(rng);
  };
  const auto drawFraction = [&] { return std::uniform_real_distribution<double>(0, 0.9)(rng); };
  const auto has = [&](const std::string& k) {
    return std::find(cases.begin(), cases.end(), k) != cases.end();
  };
  const nlohmann::json base = {{"bench", "recovery"}, {"seed", seed}, {"steps", c.steps}};
  // Per model, every rep's overhead: their median is the figure (one pair of runs is noisy).
  std::map<std::string, std::vector<double>> overheads;
  // Per (model, case) and restart mode, every rep's recovery overhead (the summary's medians).
  std::map<std::pair<std::string, std::string>, std::map<std::string, std::vector<double>>> recoveryOverheads;

  for (int rep = 0; rep < reps; ++rep) {
    for (const auto& model : models) {
      const long long target = drawStep();
      const auto report = [&](nlohmann::json line, const Observed& seen, const KillAt& at) {
        line["kill_target_step"] = at.afterStep;
        line["kill_at_fraction_of_step"] = at.fractionOfStep;
        if (seen.killUnixTime) killFigures(seen, line);
        if (!seen.workerDiedWithAgent) line["worker_outlived_agent"] = true;
        line["finished"] = seen.finished;
        line["loadavg_1m_before"] = seen.loadBefore;
        if (!seen.error.empty()) line["error"] = seen.error;
        if (!seen.logDir.empty()) line["log_dir"] = seen.logDir;
        emit(line);
        return line;
      };
      nlohmann::json modelBase = base;
      modelBase["model"] = model;
      modelBase["rep"] = rep;
      if (model == "deep") modelBase["batch_size"] = c.batch;
      std::optional<nlohmann::json> oursWorker;
      const struct {
        const char* name;
        Layout layout;
        Kill kill;
        int rank;        // whose worker, or its agent, is killed
        int worldAfter;  // ranks after the resume
      } kills[] = {
          {"worker", {"2x1", 1, 2}, Kill::kWorker, 1, 2},
          {"agents_worker", {"1x2 agents", 2, 1, "2"}, Kill::kWorker, 1, 2},
          // An agent kill leaves one node: the job goes on elastic, --nnodes 1:2.
          {"agent", {"1x2 agents", 2, 1, "1:2"}, Kill::kAgent, 1, 1},
          // Agent 0 (127.0.0.2, node rank 0: RANK=0) serves the rendezvous; its successor takes
          // it over and the new rank 0 appends to the same metrics file.
          {"host", {"3x1 agents, agent 0 hosts", 3, 1, "2:3", kQuickRdzv, true}, Kill::kAgent, 0,
           2},
          // One of the five waits as a spare and takes the lost node's rank.
          {"spare", {"5x1 agents, 1 spare", 5, 1, "4", kQuickRdzv}, Kill::kAgent, 1, 4},
          {"shrink4", {"4x1 agents", 4, 1, "3:4", kQuickRdzv}, Kill::kAgent, 1, 3}};
      for (const auto& k : kills) {
        if (!has(k.name)) continue;
        // Both modes on the same kill: the same step, the same moment in it.
        const KillAt at{target, drawFraction(), k.rank};
        std::map<std::string, double> overheadByMode;
        for (const auto& mode : c.restartModes) {
        nlohmann::json line = modelBase;
        line.update({{"system", "fsdprun"},
                     {"restart_mode", mode},
                     {"layout", k.layout.name},
                     {"agents", k.layout.agents},
                     {"workers_per_agent", k.layout.workersPerAgent},
                     {"kill", k.kill == Kill::kAgent ? "agent" : "worker"},
                     {"kill_rank_of_worker", k.rank},
                     {"snapshot_every", 1},
                     {"standby", c.standby},
                     {"world_changes", k.worldAfter != k.layout.worldSize()}});
        if (k.layout.agents > 2) {
          line.update({{"case", k.name},
                       {"nnodes", k.layout.nnodes},
                       {"rdzv", k.layout.agentHosts ? "agent 0 (is_host=true)" : "fsdprun-rdzv"},
                       {"kill_rank", k.rank},
                       {"world_size_before", k.layout.worldSize()}});
        }
        auto seen = attempt([&] { return runOurs(model, c, k.layout, k.kill, 1, at, mode); });
        if (k.layout.agents > 2) nodeFigures(k.layout.agentHosts, k.worldAfter, seen, line);
        line = report(line, seen, at);
        if (std::string(k.name) == "worker" && !oursWorker) oursWorker = line;
        if (line.contains("recovery_overhead_s")) {
          overheadByMode[mode] = line["recovery_overhead_s"].get<double>();
          recoveryOverheads[{model, k.name}][mode].push_back(overheadByMode[mode]);
        }
        }
        if (overheadByMode.contains("auto") && overheadByMode.contains("process")) {
          nlohmann::json compare = modelBase;
          compare.update({{"compare", "recovery_overhead_s, process / auto (" + std::string(k.name) + ")"},
                          {"layout", k.layout.name},
                          {"overhead_s_auto", overheadByMode["auto"]},
                          {"overhead_s_process", overheadByMode["process"]}});
          compare.update(overheadRatio(overheadByMode["process"], overheadByMode["auto"]));
          emit(compare);
        }
      }
      if (has("overhead")) {
        // No kill: half the steps are enough for a median. Off and on alternate by rep, so that
        // neither always runs on a warmer machine.
        Config shorter = c;
        shorter.steps = std::max<long long>(kWarmupSteps + 12, c.steps / 2);
        std::map<int, double> ms;
        double load = 0;
        for (const int every : rep % 2 == 0 ? std::vector<int>{0, 1} : std::vector<int>{1, 0}) {
          const auto seen = attempt([&] {
            return runOurs(model, shorter, {"2x1", 1, 2}, Kill::kNone, every, {});
          });
          load = std::max(load, seen.loadBefore);
          if (!seen.finished) {
            nlohmann::json line = modelBase;
            line.update({{"what", "snapshot_overhead"},
                         {"system", "fsdprun"},
                         {"steps", shorter.steps},
                         {"snapshot_every", every},
                         {"error", seen.error}});
            emit(line);
            continue;
          }
          ms[every] = stepMs(seen.lines);
        }
        if (ms.size() == 2) {
          nlohmann::json line = modelBase;
          line.update({{"what", "snapshot_overhead"},
                       {"system", "fsdprun"},
                       {"layout", "2x1"},
                       {"steps", shorter.steps},
                       {"step_ms_off", ms[0]},
                       {"step_ms_on", ms[1]},
                       {"ratio_on_to_off", ms[1] / ms[0]},
                       {"overhead_pct", 100.0 * (ms[1] / ms[0] - 1.0)},
                       {"loadavg_1m_before", load}});
          emit(line);
          overheads[model].push_back(100.0 * (ms[1] / ms[0] - 1.0));
        }
      }
      // The peer: DeepNet only (recovery_torch.py has no GPT), worker kills.
      if (model != "deep" || !c.peer || !has("worker")) continue;
      if (::access("/usr/bin/python3", X_OK) != 0 || ::access(c.torchrun.c_str(), R_OK) != 0) {
        nlohmann::json line = modelBase;
        line.update(
            {{"system", "torchrun"}, {"unavailable", "needs python3-torch and " + c.torchrun}});
        emit(line);
        continue;
      }
      // A PyTorch script with fsdprun's module (snapshots every step), on the same kill step.
      std::optional<nlohmann::json> python;
      {
        const KillAt at{target, drawFraction()};
        nlohmann::json line = modelBase;
        line.update({{"system", "fsdprun + import fsdprun (PyTorch DDP script)"},
                     {"layout", "2x1"},
                     {"agents", 1},
                     {"workers_per_agent", 2},
                     {"kill", "worker"},
                     {"snapshot_every", 1}});
        python = report(line, attempt([&] { return runPythonModule(c, 1, Kill::kWorker, at); }), at);
      }
      if (has("overhead")) {
        // The module's per-step cost: snapshot() every step vs none, alternating by rep.
        Config shorter = c;
        shorter.steps = std::max<long long>(kWarmupSteps + 12, c.steps / 2);
        std::map<int, double> ms;
        for (const int every : rep % 2 == 0 ? std::vector<int>{0, 1} : std::vector<int>{1, 0}) {
          const auto seen = attempt([&] { return runPythonModule(shorter, every, Kill::kNone, {}); });
          if (seen.finished) ms[every] = stepMs(seen.lines);
        }
        nlohmann::json line = modelBase;
        line.update({{"what", "snapshot_overhead"},
                     {"system", "fsdprun + import fsdprun (PyTorch DDP script)"},
                     {"layout", "2x1"},
                     {"steps", shorter.steps}});
        if (ms.size() == 2) {
          line.update({{"step_ms_off", ms[0]},
                       {"step_ms_on", ms[1]},
                       {"overhead_pct", 100.0 * (ms[1] / ms[0] - 1.0)}});
        } else {
          line["error"] = "a run did not finish";
        }
        emit(line);
      }
      for (const long long k : checkpointEvery) {
        const KillAt at{target, drawFraction()};
        nlohmann::json line = modelBase;
        line.update({{"system", "torchrun"},
                     {"layout", "2x1"},
                     {"agents", 1},
                     {"workers_per_agent", 2},
                     {"kill", "worker"},
                     {"checkpoint_every", k}});
        const auto seen = attempt([&] { return runPeer(c, static_cast<int>(k), at); });
        line = report(line, seen, at);
        if (oursWorker && oursWorker->contains("kill_to_caught_up_s") &&
            line.contains("kill_to_caught_up_s")) {
          nlohmann::json compare = modelBase;
          compare.update({{"compare", "kill_to_caught_up_s, torchrun / fsdprun (2x1, worker kill)"},
                          {"checkpoint_every", k},
                          {"ratio", line["kill_to_caught_up_s"].get<double>() /
                                        (*oursWorker)["kill_to_caught_up_s"].get<double>()}});
          emit(compare);
        }
        if (python && python->contains("kill_to_caught_up_s") && line.contains("kill_to_caught_up_s")) {
          nlohmann::json compare = modelBase;
          compare.update({{"compare", "kill_to_caught_up_s, torchrun / fsdprun with import fsdprun (same "
                                      "script, 2x1, worker kill)"},
                          {"checkpoint_every", k},
                          {"ratio", line["kill_to_caught_up_s"].get<double>() /
                                        (*python)["kill_to_caught_up_s"].get<double>()}});
          emit(compare);
        }
      }
    }
  }
  for (const auto& [model, each] : overheads) {
    emit({{"bench", "recovery"},
          {"what", "snapshot_overhead_median"},
          {"model", model},
          {"seed", seed},
          {"reps", each.size()},
          {"overhead_pct_median", median(each)},
          {"overhead_pct_each", each}});
  }
  // Per case, over the reps: the medians' ratio is the figure the goal is read against.
  for (const auto& [modelAndCase, byMode] : recoveryOverheads) {
    if (!byMode.contains("auto") || !byMode.contains("process")) continue;
    const auto& [model, killCase] = modelAndCase;
    const auto& autoEach = byMode.at("auto");
    const auto& processEach = byMode.at("process");
    nlohmann::json line = {{"bench", "recovery"},
                           {"compare", "median recovery_overhead_s over the reps, process / auto (" + killCase + ")"},
                           {"model", model},
                           {"seed", seed},
                           {"reps", std::min(autoEach.size(), processEach.size())},
                           {"overhead_s_auto_each", autoEach},
                           {"overhead_s_process_each", processEach},
                           {"overhead_s_auto", median(autoEach)},
                           {"overhead_s_process", median(processEach)}};
    line.update(overheadRatio(median(processEach), median(autoEach)));
    emit(line);
  }
}

}  // namespace fsdp::bench
