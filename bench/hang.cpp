// fsdp-bench hang: a 3-rank DeepNet job whose rank 1 freezes (SIGSTOP) after a step, with the
// hang watchdog at --hang_timeout 5, at its default (auto), and off (the job then waits for the
// communicator's own timeout, 300 s): seconds from the stall to the report (to the failure, when
// off), to the state restored and to the first new step, from rank 0's metrics lines and the
// launcher's log; the same for a rank stalled just before a checkpoint save (saveCase). Then the recorder's cost per DeepNet step: step times with the recorder on and
// off (FSDPRUN_FLIGHT_RECORDER=0), alternating, and the collectives each step records.
#include <unistd.h>

#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>

#include "bench.hpp"
#include "fsdp/common/error.hpp"
#include "comm/recorded_communicator.hpp"
#include "null_communicator.hpp"
#include "recovery_job.hpp"

namespace fsdp::bench {
namespace {

using namespace recovery_job;

// The unix time of the first line of `path` that contains `needle`, from its spdlog stamp
// "[YYYY-mm-dd HH:MM:SS.mmm]" (local time); nullopt when there is none.
std::optional<double> loggedAt(const std::string& path, const std::string& needle) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find(needle) == std::string::npos || line.size() < 25 || line[0] != '[') continue;
    std::tm tm{};
    if (::strptime(line.c_str() + 1, "%Y-%m-%d %H:%M:%S", &tm) == nullptr) continue;
    tm.tm_isdst = -1;
    return static_cast<double>(std::mktime(&tm)) + std::stod(line.substr(20, 4));
  }
  return std::nullopt;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(item);
  return out;
}

std::vector<std::string> environment(const std::string& runId, bool recorder) {
  auto env = jobEnvironment(runId);
  std::erase_if(env, [](const std::string& e) { return e.starts_with("FSDPRUN_FLIGHT_RECORDER="); });
  env.emplace_back(recorder ? "FSDPRUN_FLIGHT_RECORDER=1" : "FSDPRUN_FLIGHT_RECORDER=0");
  return env;
}

void stallCase(const std::string& which, long long steps, long long stallStep) {
  RunDir dir;
  const std::string runId = "bench-hang-" + which + "-" + std::to_string(::getpid());
  const std::string metrics = dir.path() + "/metrics.jsonl";
  const std::string timeout = which == "off" ? "0" : which;
  const Launch launch{{mnistJob(runId, metrics, timeout, steps, stallStep, "shallow")}, environment(runId, true), runId, metrics};
  const auto seen = runJob(launch, dir, Kill::kNone, {}, std::chrono::seconds(600));
  nlohmann::json line{{"bench", "hang"}, {"case", "stall"}, {"hang_timeout", which}, {"ranks", 3},
                      {"stall_after_step", stallStep}, {"finished", seen.finished}};
  // The stall: rank 1 stops after its step K, before rank 0 can log step K (logging reduces
  // over every rank). Rank 0's last line of the first attempt, plus its median step time for
  // each step it did not log, estimates the moment.
  std::optional<double> stall;
  {
    std::vector<double> stepMs;
    double lastTime = 0;
    long long lastStep = 0;
    for (const auto& l : seen.lines) {
      if (l.value("type", "") == "resume") break;
      if (l.value("type", "") != "train") continue;
      stepMs.push_back(l.value("step_time_ms", 0.0));
      lastTime = l.value("unix_time", 0.0);
      lastStep = l.value("step", 0LL);
    }
    if (!stepMs.empty() && lastStep <= stallStep) {
      stall = lastTime + static_cast<double>(stallStep - lastStep) * percentile(stepMs, 0.5) / 1000;
    }
  }
  const auto reported = which == "off" ? loggedAt(dir.path() + "/launcher0.err", ") failed: ")
                                       : loggedAt(dir.path() + "/launcher0.err", "the job is hung");
  if (!seen.error.empty()) line["error"] = seen.error;
  if (stall && reported) line["stall_to_report_s"] = *reported - *stall;
  bool resumed = false;
  for (const auto& l : seen.lines) {
    if (!stall) break;
    if (l.value("type", "") == "resume") {
      resumed = true;
      line["resumed_step"] = l.value("step", 0LL);
      line["steps_redone"] = stallStep - l.value("step", 0LL);
      line["stall_to_restored_s"] = l.value("unix_time", 0.0) - *stall;
    } else if (resumed && l.value("type", "") == "train") {
      line["stall_to_first_step_s"] = l.value("unix_time", 0.0) - *stall;
      break;
    }
  }
  if (which == "off") line["note"] = "no watchdog: the shared-memory collective's own timeout (300 s) ends the attempt";
  emit(line);
}

// A stall before a checkpoint save: tests/integration/hang/stall_worker (a hand-written loop of 3
// ranks, a save every 3 steps) whose rank 1 spins in its own code just before the save of step
// `stallStep` (a multiple of 3) while the others wait for it in the save and the next step, at
// --hang_timeout `timeout`: seconds from the stall to the report, to the restore from the newest
// checkpoint, and to the first new step. Before, this hang was never reported.
void saveCase(const std::string& timeout, long long steps, long long stallStep) {
  RunDir dir;
  const std::string runId = "bench-hang-save-" + std::to_string(::getpid());
  const std::string metrics = dir.path() + "/metrics.jsonl";
  const std::string bin = binDir();
  const std::vector<std::string> argv = {
      bin + "/fsdprun", "--nproc_per_node", "3", "--max_restarts", "1", "--rdzv_id", runId, "--hang_timeout",
      timeout, bin + "/stall_worker", "--dir", dir.path(), "--steps", std::to_string(steps), "--save_every", "3",
      "--stall_rank", "1", "--stall_at", "save", "--stall_step", std::to_string(stallStep), "--metrics", metrics};
  nlohmann::json line{{"bench", "hang"}, {"case", "stall_before_save"}, {"hang_timeout", timeout}, {"ranks", 3},
                      {"program", "stall_worker (hand-written loop, Checkpointer::save every 3 steps)"},
                      {"stall_before_save_of_step", stallStep}};
  if (::access((bin + "/stall_worker").c_str(), X_OK) != 0) {
    line["error"] = bin + "/stall_worker is not built (it is a test program: build with FSDP_BUILD_TESTS=ON)";
    emit(line);
    return;
  }
  const Launch launch{{argv}, environment(runId, true), runId, metrics};
  const auto seen = runJob(launch, dir, Kill::kNone, {}, std::chrono::seconds(600));
  line["finished"] = seen.finished;
  std::optional<double> stall, resumed, firstStep;
  for (const auto& l : seen.lines) {
    const std::string type = l.value("type", "");
    if (type == "stall" && !stall) stall = l.value("unix_time", 0.0);
    if (type == "resume" && stall && !resumed) {
      resumed = l.value("unix_time", 0.0);
      line["resumed_step"] = l.value("step", 0LL);
    }
    if (type == "train" && resumed && !firstStep) firstStep = l.value("unix_time", 0.0);
  }
  const auto reported = loggedAt(dir.path() + "/launcher0.err", "the job is hung");
  if (!seen.error.empty()) line["error"] = seen.error;
  if (stall && reported) line["stall_to_report_s"] = *reported - *stall;
  if (stall && resumed) line["stall_to_restored_s"] = *resumed - *stall;
  if (stall && firstStep) line["stall_to_first_step_s"] = *firstStep - *stall;
  if (!reported) line["note"] = "no hang report in the launcher's log";
  emit(line);
}

void overhead(long long steps, long long reps) {
  NullCommunicator plain;
  auto recorded = worker::detail::recordCollectives(std::make_unique<NullCommunicator>(), "world");
  const double plainNs = nsPerCollective(plain, 200000);
  const double recordedNs = nsPerCollective(*recorded, 200000);
  std::vector<double> on, off, ratios;
  double perStep = 0;
  for (long long rep = 0; rep < reps; ++rep) {
    // Which side runs first alternates: on this VM a run is slower or faster by where it falls.
    for (const bool recorder : {rep % 2 == 0, rep % 2 != 0}) {
      RunDir dir;
      const std::string runId = "bench-hang-cost-" + std::to_string(::getpid()) + "-" + std::to_string(rep);
      const std::string metrics = dir.path() + "/metrics.jsonl";
      const Launch launch{{mnistJob(runId, metrics, "auto", steps, 0, "deep")}, environment(runId, recorder), runId, metrics};
      const auto seen = runJob(launch, dir, Kill::kNone, {}, std::chrono::seconds(600));
      const auto [ms, collectives] = stepCost(seen);
      (recorder ? on : off).push_back(ms);
      if (recorder) perStep = collectives;
    }
    if (off.back() > 0) ratios.push_back(on.back() / off.back());
  }
  const double stepMs = percentile(on, 0.5);
  const double recorderNs = std::max(0.0, recordedNs - plainNs);
  emit({{"bench", "hang"}, {"case", "recorder_cost"}, {"model", "deep"}, {"ranks", 3}, {"steps", steps}, {"reps", reps},
        {"step_ms_recorder_on", stepMs}, {"step_ms_recorder_off", percentile(off, 0.5)},
        {"median_ratio_on_over_off", ratios.empty() ? 0.0 : percentile(ratios, 0.5)},
        {"collectives_per_step", perStep}, {"ns_per_collective_plain", plainNs},
        {"ns_per_collective_recorded", recordedNs},
        {"recorder_share_of_step_pct", stepMs > 0 ? 100.0 * recorderNs * perStep / (stepMs * 1e6) : 0.0}});
}

}  // namespace

void hang(const Args& args) {
  const long long steps = args.ints("steps", "20").front();
  const long long stallStep = args.ints("stall_step", "6").front();
  const long long reps = args.ints("reps", "2").front();
  const auto cases = split(args.str("cases", "5,save,auto,off,cost"));
  for (const auto& c : cases) {
    char* end = nullptr;
    const double seconds = std::strtod(c.c_str(), &end);
    if (c == "cost" || c == "auto" || c == "off" || c == "save" ||
        (!c.empty() && *end == '\0' && seconds > 0)) {
      continue;
    }
    throw ConfigError("--cases '" + c + "': expected a number of seconds, auto, off, save or cost");
  }
  for (const auto& c : cases) {
    if (c == "cost") {
      overhead(std::min(steps, 12LL), reps);
    } else if (c == "save") {
      saveCase("5", std::max(steps, 12LL), 6);
    } else {
      stallCase(c, steps, stallStep);
    }
  }
}

}  // namespace fsdp::bench
