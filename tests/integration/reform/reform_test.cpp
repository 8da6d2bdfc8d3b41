// Survivors never exit (--restart_mode auto): the real launcher, the real mnist trainer, real
// SIGKILLs from outside in the middle of a step. A 3-rank job whose rank 1 is killed ends with
// the parameters of an uninterrupted run, in both modes, and in auto mode ranks 0 and 2 keep
// their processes (their pids are read before the kill and after the re-formation); a second
// kill while the survivors re-form falls back to process restarts; a hang kills the stuck rank
// only; a stopped survivor restarts as a process, and one stopped while re-forming is the rank
// the hang report names. Every wait is on an event (a metrics line, a log line, a process), bounded.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "fsdp/common/process.hpp"
#include "processes.hpp"
#include "run_command.hpp"
#include "summary_line.hpp"

namespace {

namespace fs = std::filesystem;
using fsdp::testing::metricsLines;
using fsdp::testing::readFile;
using fsdp::testing::runCommand;
using fsdp::testing::summaryOf;
using fsdp::testing::TempDir;
using nlohmann::json;
using namespace std::chrono_literals;

const std::string kBin = FSDP_BIN_DIR;
const std::string kData = "/usr/share/datasets/fashion-mnist";
constexpr int kSteps = 40;
constexpr auto kBound = 240s;

std::vector<std::string> job(const std::string& mode, const std::string& runId, const std::string& metrics,
                             const std::vector<std::string>& extra = {}) {
  std::vector<std::string> argv = {kBin + "/fsdprun", "--nproc_per_node", "3", "--max_restarts", "3",
                                   "--restart_mode", mode, "--rdzv_id", runId, kBin + "/mnist",
                                   "--max_steps", std::to_string(kSteps), "--batch_size", "96", "--no_eval",
                                   "--progress", "none", "--log_every", "1", "--metrics_file", metrics};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

// The job's workers by rank: processes carrying `tag` in their environment and a RANK.
std::map<int, int> workersByRank(const std::string& tag) {
  std::map<int, int> out;
  for (const int pid : fsdp::testing::processesWithEnvironment(tag)) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/environ");
    std::string entry;
    while (std::getline(in, entry, '\0')) {
      if (entry.rfind("RANK=", 0) == 0) out[std::stoi(entry.substr(5))] = pid;
    }
  }
  return out;
}

// Waits until `ready()` holds, up to kBound; false when the job ended first or the bound passed.
template <typename Ready>
bool waitFor(fsdp::ChildProcess& job, Ready ready) {
  const auto until = std::chrono::steady_clock::now() + kBound;
  while (std::chrono::steady_clock::now() < until) {
    if (ready()) return true;
    if (job.tryWait()) return ready();
    std::this_thread::sleep_for(20ms);  // a poll of files the job writes, not a wait for time to pass
  }
  return false;
}

int newestStep(const std::string& metrics) {
  int step = 0;
  for (const auto& line : metricsLines(metrics)) {
    if (line.value("type", "") == "train") step = std::max(step, line.value("step", 0));
  }
  return step;
}

std::optional<json> resumeLine(const std::string& metrics) {
  for (const auto& line : metricsLines(metrics)) {
    if (line.value("type", "") == "resume") return line;
  }
  return std::nullopt;
}

// The steps of rank `rank`'s (world 3) pieces whose memory the keeper gave back to it for reuse
// (its debug log).
std::set<int> stepsTakenBack(const std::string& err, int rank) {
  std::istringstream lines(err);
  const std::string piece = "snapshot keeper: the snapshot of rank " + std::to_string(rank) + " (world 3) at step ";
  std::set<int> steps;
  for (std::string line; std::getline(lines, line);) {
    const auto at = line.find(piece);
    if (at != std::string::npos && line.find("goes back to its rank for reuse") != std::string::npos) {
      steps.insert(std::stoi(line.substr(at + piece.size())));
    }
  }
  return steps;
}

struct Finished {
  int exitCode = -1;
  std::string out, err;
};

Finished finish(fsdp::ChildProcess& job, const TempDir& dir) {
  const auto until = std::chrono::steady_clock::now() + kBound;
  std::optional<int> status;
  while (!(status = job.tryWait()) && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(20ms);
  if (!status) job.signal(SIGKILL);
  return {status && WIFEXITED(*status) ? WEXITSTATUS(*status) : -1, readFile(dir.path() + "/out"),
          readFile(dir.path() + "/err")};
}

// One job's names and files: its run id, the tag its processes carry, its metrics file.
struct JobFiles {
  explicit JobFiles(const std::string& name)
      : runId("reform-" + name + "-" + std::to_string(::getpid())),
        tag("FSDP_REFORM_TAG=" + runId),
        metrics(dir.path() + "/m.jsonl") {}
  std::string err() const { return readFile(dir.path() + "/err"); }
  TempDir dir;
  std::string runId, tag, metrics;
};

// Waits for rank 0's step 10 (every rank is in a later step): the workers by rank then, none
// when the job ended first.
std::map<int, int> pastStep10(fsdp::ChildProcess& job, const JobFiles& f) {
  if (!waitFor(job, [&] { return newestStep(f.metrics) >= 10; })) return {};
  return workersByRank(f.tag);
}

// Waits until the job's log says `text`.
bool logSays(fsdp::ChildProcess& job, const JobFiles& f, const std::string& text) {
  return waitFor(job, [&] { return f.err().find(text) != std::string::npos; });
}

class Reform : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(kData)) return;
    TempDir dir;
    auto argv = job("process", "reform-reference-" + std::to_string(::getpid()), dir.path() + "/m.jsonl");
    const auto r = runCommand(argv, kBound);
    ASSERT_EQ(r.exitCode, 0) << r.err;
    reference_ = summaryOf(r.out).value("params_sha256", "");
    ASSERT_FALSE(reference_.empty()) << r.out;
  }
  void SetUp() override {
    if (!fs::exists(kData)) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }

  // Starts the job in the background, tagged so that its processes can be found.
  fsdp::ChildProcess start(const std::vector<std::string>& argv, const std::string& tag, const TempDir& dir) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    env.push_back(tag);
    env.push_back("TMPDIR=" + dir.path());
    env.insert(env.end(), extraEnv_.begin(), extraEnv_.end());
    return fsdp::ChildProcess::spawn(
        {.argv = argv, .env = env, .stdoutPath = dir.path() + "/out", .stderrPath = dir.path() + "/err"});
  }

  static inline std::string reference_;
  std::vector<std::string> extraEnv_;
};

// Must-show 2: rank 1 SIGKILLed in the middle of a step; the same parameters in both modes as
// an uninterrupted run; in auto mode the survivors' pids stay.
TEST_F(Reform, ARankKilledMidStepEndsBitIdenticalInBothModesAndTheSurvivorsKeepTheirProcesses) {
  extraEnv_ = {"FSDP_LOG_LEVEL=debug"};  // the keeper's debug line: rank 1's old snapshots reused
  for (const std::string mode : {"auto", "process"}) {
    SCOPED_TRACE("--restart_mode " + mode);
    TempDir dir;
    const std::string runId = "reform-" + mode + "-" + std::to_string(::getpid());
    const std::string tag = "FSDP_REFORM_TAG=" + runId;
    const std::string metrics = dir.path() + "/m.jsonl";
    auto proc = start(job(mode, runId, metrics), tag, dir);
    ASSERT_TRUE(waitFor(proc, [&] { return newestStep(metrics) >= 10; })) << readFile(dir.path() + "/err");
    const auto before = workersByRank(tag);
    ASSERT_EQ(before.size(), 3u);
    ::kill(before.at(1), SIGKILL);  // rank 0 logged step 10: every rank is in a later step
    ASSERT_TRUE(waitFor(proc, [&] { return resumeLine(metrics).has_value(); })) << readFile(dir.path() + "/err");
    const auto after = workersByRank(tag);
    const auto r = finish(proc, dir);
    ASSERT_EQ(r.exitCode, 0) << r.err;
    const auto summary = summaryOf(r.out);
    EXPECT_EQ(summary.value("steps", 0), kSteps);
    EXPECT_EQ(summary.value("params_sha256", ""), reference_) << r.out;
    const auto resume = *resumeLine(metrics);
    EXPECT_EQ(resume.value("source", ""), "memory");
    // The new rank 1 restored, then took back the memory of its rank's pieces that the keeper's
    // next puts would drop, for its next snapshots: the piece it restored from too, once its
    // first step moved the state out of it (and the result above is still the uninterrupted run's).
    const auto takenBack = stepsTakenBack(r.err, 1);
    EXPECT_FALSE(takenBack.empty()) << r.err;
    // Where the killed rank's newest piece was the restored step (the keeper's oldest, two before
    // it, came back first; rank 1 may also have put the next step just before the kill), the
    // restored piece came back once the state left it.
    const int resumed = resume.value("step", -1);
    if (takenBack.contains(resumed - 2)) {
      EXPECT_TRUE(takenBack.contains(resumed)) << r.err;
    }
    if (mode == "auto") {
      EXPECT_EQ(resume.value("path", ""), "in_process") << resume.dump();
      // How long rank 0 went on after the agent's notice: known, and not negative.
      EXPECT_GE(resume.value("notice_to_reform_ms", -1.0), 0.0) << resume.dump();
      ASSERT_EQ(after.size(), 3u);
      EXPECT_EQ(after.at(0), before.at(0)) << "rank 0 kept its process";
      EXPECT_EQ(after.at(2), before.at(2)) << "rank 2 kept its process";
      EXPECT_NE(after.at(1), before.at(1)) << "rank 1 is a new process";
      EXPECT_NE(r.err.find("rank(s) 0, 2 re-form in process; 1 worker(s) start as new processes"), std::string::npos)
          << r.err;
      // The new process's constructor saw the survivors and left rank 0's weights alone (the
      // restore wrote them: the end above is the uninterrupted run's).
      EXPECT_NE(r.err.find("rank 1: survivors of an earlier round re-form with this process: rank "
                           "0's weights are not"),
                std::string::npos)
          << r.err;
    } else {
      EXPECT_EQ(r.err.find("survivors of an earlier round re-form with this process"),
                std::string::npos)
          << r.err;
      EXPECT_EQ(resume.value("path", ""), "process") << resume.dump();
      for (const auto& [rank, pid] : after) EXPECT_NE(pid, before.at(rank)) << "rank " << rank << " restarted";
    }
  }
}

// A replacement killed in turn: the new rank 1 took back its rank's oldest piece's memory and
// wrote its first snapshot there (later ones cycle through it), and is killed 5 steps on; its own
// replacement restores pieces the first replacement wrote. Both recoveries in process, the end
// still the uninterrupted run's.
TEST_F(Reform, AReplacementKilledInTurnIsReplacedInProcessAgainAndTheEndIsUnchanged) {
  const JobFiles f("twice");
  const std::string& metrics = f.metrics;
  extraEnv_ = {"FSDP_LOG_LEVEL=debug"};
  auto proc = start(job("auto", f.runId, metrics), f.tag, f.dir);
  const auto first = pastStep10(proc, f);
  ASSERT_EQ(first.size(), 3u) << f.err();
  ::kill(first.at(1), SIGKILL);
  ASSERT_TRUE(waitFor(proc, [&] { return resumeLine(metrics).has_value(); })) << f.err();
  const int resumed = resumeLine(metrics)->value("step", 0);
  // A few snapshots later (each written into memory it took back): the new rank 1 goes too.
  ASSERT_TRUE(waitFor(proc, [&] { return newestStep(metrics) >= resumed + 5; })) << f.err();
  const auto second = workersByRank(f.tag);
  ASSERT_EQ(second.size(), 3u);
  ASSERT_NE(second.at(1), first.at(1));
  ::kill(second.at(1), SIGKILL);
  const auto r = finish(proc, f.dir);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_EQ(summaryOf(r.out).value("params_sha256", ""), reference_) << r.out;
  EXPECT_EQ(summaryOf(r.out).value("steps", 0), kSteps);
  std::vector<json> resumes;
  for (const auto& line : metricsLines(metrics)) {
    if (line.value("type", "") == "resume") resumes.push_back(line);
  }
  ASSERT_EQ(resumes.size(), 2u) << readFile(metrics);
  for (const auto& resume : resumes) EXPECT_EQ(resume.value("path", ""), "in_process") << resume.dump();
  EXPECT_GE(resumes[1].value("step", 0), resumed + 4) << "the second restore is of a step the replacement wrote";
  EXPECT_FALSE(stepsTakenBack(r.err, 1).empty()) << r.err;
  EXPECT_EQ(workersByRank(f.tag), (std::map<int, int>{})) << "nothing of the job outlives it";
}

// Must-show 4: a second kill while the survivors re-form (rank 2, once it dropped its step)
// falls back to process restarts, and the job still ends as the uninterrupted run does.
TEST_F(Reform, ASecondKillDuringTheReformationFallsBackToProcessRestartsAndTheJobFinishes) {
  const JobFiles f("second");
  auto proc = start(job("auto", f.runId, f.metrics), f.tag, f.dir);
  const auto before = pastStep10(proc, f);
  ASSERT_EQ(before.size(), 3u) << f.err();
  ::kill(before.at(1), SIGKILL);
  ASSERT_TRUE(logSays(proc, f, "rank 2: the step in progress is dropped")) << f.err();
  // The agent handed the new round over (survivors told, the new rank 1 starting): rank 2 is
  // killed while every survivor re-forms, before the new process can have started.
  ASSERT_TRUE(logSays(proc, f, "re-form in process; 1 worker(s) start as new processes"))
      << f.err();
  ::kill(before.at(2), SIGKILL);
  const auto r = finish(proc, f.dir);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_EQ(summaryOf(r.out).value("params_sha256", ""), reference_) << r.out;
  EXPECT_EQ(summaryOf(r.out).value("steps", 0), kSteps);
  // Rank 0, re-forming too, is named with the reason that holds (not "not in a training loop").
  EXPECT_NE(r.err.find("rank(s) 0 restart as processes: a second failure while they re-formed "
                       "in process"),
            std::string::npos)
      << r.err;
}

// Survivors inside their backward when the notice comes (they hold there while rank 1 kills
// itself in its own): each ends it at its next gradient, not at the collective after its last,
// and the gradients that backward left behind do not reach the redone step (the end is the
// uninterrupted run's).
TEST_F(Reform, SurvivorsInTheirBackwardEndItAtTheirNextGradientAndTheEndIsUnchanged) {
  const JobFiles f("backward");
  auto proc = start(job("auto", f.runId, f.metrics,
                        {"--fault_kill_at_step", "8", "--fault_kill_rank", "1", "--fault_kind",
                         "backward"}),
                    f.tag, f.dir);
  const auto r = finish(proc, f.dir);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_EQ(summaryOf(r.out).value("params_sha256", ""), reference_) << r.out;
  EXPECT_EQ(summaryOf(r.out).value("steps", 0), kSteps);
  const auto resume = resumeLine(f.metrics);
  ASSERT_TRUE(resume.has_value()) << r.err;
  EXPECT_EQ(resume->value("path", ""), "in_process") << resume->dump();
  EXPECT_EQ(resume->value("step", -1), 8) << resume->dump();
  for (const int rank : {0, 2}) {
    EXPECT_NE(r.err.find("rank " + std::to_string(rank) +
                         ": the step in progress is dropped, the world re-forms in process "
                         "(backward: the communicator was aborted"),
              std::string::npos)
        << r.err;
  }
}

// A survivor stopped (SIGSTOP) while the others re-form: the round waits for it until the hang
// timeout, and the report names it, not the ranks waiting for it (whose earlier rounds' records
// once hid where it was); its error file is written though it has no folder of this attempt.
TEST_F(Reform, ASurvivorStoppedWhileReformingIsTheRankTheHangReportNames) {
  const JobFiles f("stopped");
  auto argv = job("auto", f.runId, f.metrics);
  argv.insert(argv.begin() + 1, {"--hang_timeout", "3"});
  auto proc = start(argv, f.tag, f.dir);
  const auto before = pastStep10(proc, f);
  ASSERT_EQ(before.size(), 3u) << f.err();
  ::kill(before.at(1), SIGKILL);
  ASSERT_TRUE(logSays(proc, f, "rank 2: the step in progress is dropped")) << f.err();
  ::kill(before.at(2), SIGSTOP);  // re-forming: before or after it joined the new round
  const auto r = finish(proc, f.dir);  // the agent killed the stopped process
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.err.find("the job is hung"), std::string::npos) << r.err;
  // Named as stopped (its state), and where the records tell, as the one the others wait for.
  EXPECT_NE(r.err.find("rank 2 is stopped (SIGSTOP or SIGTSTP)"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("the transport itself is stuck"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank(s) 2 failed or are stuck"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("could not write the hang report"), std::string::npos) << r.err;
  EXPECT_EQ(summaryOf(r.out).value("params_sha256", ""), reference_) << r.out;
  EXPECT_EQ(summaryOf(r.out).value("steps", 0), kSteps);
}

// A survivor already stopped when a peer fails cannot take the abort notice: it starts again as
// a process (one line says why), the others re-form in process, and nothing waits for a hang.
TEST_F(Reform, AStoppedSurvivorRestartsAsAProcessAndTheOthersReformInProcess) {
  const JobFiles f("frozen");
  auto proc = start(job("auto", f.runId, f.metrics), f.tag, f.dir);
  const auto before = pastStep10(proc, f);
  ASSERT_EQ(before.size(), 3u) << f.err();
  ::kill(before.at(2), SIGSTOP);
  // The agent has seen it stop (its warning), then rank 1 goes.
  ASSERT_TRUE(logSays(proc, f, "was stopped by SIGSTOP")) << f.err();
  ::kill(before.at(1), SIGKILL);
  const auto r = finish(proc, f.dir);  // the agent killed the stopped process
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.err.find("rank(s) 2 restart as processes: stopped"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank(s) 0 re-form in process; 2 worker(s) start as new processes"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("the job is hung"), std::string::npos) << r.err;
  EXPECT_EQ(summaryOf(r.out).value("params_sha256", ""), reference_) << r.out;
  const auto resume = resumeLine(f.metrics);
  ASSERT_TRUE(resume.has_value());
  EXPECT_EQ(resume->value("path", ""), "in_process");
}

// A survivor busy in its own code (a spin after its step, not a collective) when a peer dies:
// the abort notice wakes no collective of its, it never joins the new round, and the hang report
// names it as not joined, not the ranks that wait for it. It is killed; rank 0, still
// re-forming, starts again as a process too, and the job ends as the uninterrupted run does.
TEST_F(Reform, ASurvivorBusyInItsOwnCodeIsNamedAsNotJoinedWhenTheRoundHangs) {
  const JobFiles f("busy");
  const std::string marker = f.dir.path() + "/spinning";
  auto argv = job("auto", f.runId, f.metrics,
                  {"--fault_kill_at_step", "8", "--fault_kill_rank", "2", "--fault_kind", "loop",
                   "--fault_marker", marker});
  argv.insert(argv.begin() + 1, {"--hang_timeout", "3"});
  auto proc = start(argv, f.tag, f.dir);
  // Rank 2 finished step 8 and spins from here on (before rank 0 can log step 8: its log line
  // waits for rank 2).
  ASSERT_TRUE(waitFor(proc, [&] { return fs::exists(marker); })) << f.err();
  const auto before = workersByRank(f.tag);
  ASSERT_EQ(before.size(), 3u) << f.err();
  ::kill(before.at(1), SIGKILL);
  const auto r = finish(proc, f.dir);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.err.find("round 1: rank(s) 0, 2 re-form in process"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the job is hung"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 2 has not joined this round"), std::string::npos) << r.err;
  // The restart's one-line reason names it too (not the new rank 1, which waits for it).
  EXPECT_NE(r.err.find("asked to restart: the job hung: rank 2 has not joined this round"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("rank 0 has not joined this round"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank(s) 2 failed or are stuck"), std::string::npos) << r.err;
  EXPECT_EQ(summaryOf(r.out).value("params_sha256", ""), reference_) << r.out;
  EXPECT_EQ(summaryOf(r.out).value("steps", 0), kSteps);
}

// Must-show 4: a hang declared kills the stuck rank only; the others re-form in process.
TEST_F(Reform, AHangKillsTheStuckRankAndTheOthersReformInProcess) {
  TempDir dir;
  const std::string runId = "reform-hang-" + std::to_string(::getpid());
  const std::string metrics = dir.path() + "/m.jsonl";
  auto argv = job("auto", runId, metrics, {"--fault_kill_at_step", "8", "--fault_kill_rank", "1", "--fault_kind", "loop"});
  argv.insert(argv.begin() + 1, {"--hang_timeout", "3"});
  const auto r = runCommand(argv, kBound, {"FSDP_REFORM_TAG=" + runId, "TMPDIR=" + dir.path()});
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.err.find("rank(s) 1 failed or are stuck"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank(s) 0, 2 re-form in process"), std::string::npos) << r.err;
  EXPECT_EQ(summaryOf(r.out).value("params_sha256", ""), reference_) << r.out;
  const auto resume = resumeLine(metrics);
  ASSERT_TRUE(resume.has_value());
  EXPECT_EQ(resume->value("path", ""), "in_process");
}

// ---- a hand-written loop (reform.hpp's example): reform_loop_worker.cpp ----------------------

struct LoopRun {
  int exitCode = -1;
  std::string err;
  std::map<int, std::pair<std::string, int>> finals;  // rank -> (state hash, pid at the end)
  std::map<int, int> firstPids;                        // rank -> pid of its first attempt
};

LoopRun runLoop(const std::string& mode, int killStep, const std::vector<std::string>& extra = {}) {
  TempDir dir;
  std::vector<std::string> argv = {kBin + "/fsdprun",
                                   "--nproc_per_node", "3",
                                   "--max_restarts", "3",
                                   "--restart_mode", mode,
                                   "--rdzv_id", "loop-" + std::to_string(::getpid()),
                                   kBin + "/reform_loop_worker", dir.path(), "60",
                                   std::to_string(killStep)};
  argv.insert(argv.end(), extra.begin(), extra.end());
  const auto r = runCommand(argv, kBound, {"FSDP_LOG_LEVEL=debug", "TMPDIR=" + dir.path()});
  LoopRun run{r.exitCode, r.err, {}, {}};
  for (int rank = 0; rank < 3; ++rank) {
    std::istringstream final(readFile(dir.path() + "/final_" + std::to_string(rank)));
    std::string hash;
    int pid = 0;
    if (final >> hash >> pid) run.finals[rank] = {hash, pid};
    std::istringstream first(readFile(dir.path() + "/start_" + std::to_string(rank) + "_0"));
    if (first >> pid) run.firstPids[rank] = pid;
  }
  return run;
}

// The loop of reform.hpp, rank 1 killed after step 25 of 60: ranks 0 and 2 keep their processes
// and end where an uninterrupted run and a process-mode run end, state hash for state hash. The
// new rank 1's own weights differ (seeded by the restart count) and its constructor broadcasts
// none of rank 0's (survivors are in its round): its restore wrote every shard, the frozen
// layer's too, and the BatchNorm's buffers.
TEST(ReformLoop, AHandWrittenLoopReformsInProcessAndEndsAsTheUninterruptedRun) {
  const auto reference = runLoop("auto", 0);
  ASSERT_EQ(reference.exitCode, 0) << reference.err;
  ASSERT_EQ(reference.finals.size(), 3u) << reference.err;
  const auto survived = runLoop("auto", 25);
  ASSERT_EQ(survived.exitCode, 0) << survived.err;
  const auto restarted = runLoop("process", 25);
  ASSERT_EQ(restarted.exitCode, 0) << restarted.err;
  for (int rank = 0; rank < 3; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    EXPECT_EQ(survived.finals.at(rank).first, reference.finals.at(rank).first) << survived.err;
    EXPECT_EQ(restarted.finals.at(rank).first, reference.finals.at(rank).first) << restarted.err;
    EXPECT_NE(restarted.finals.at(rank).second, restarted.firstPids.at(rank))
        << "process mode restarts it";
  }
  EXPECT_EQ(survived.finals.at(0).second, survived.firstPids.at(0)) << "rank 0 kept its process";
  EXPECT_EQ(survived.finals.at(2).second, survived.firstPids.at(2)) << "rank 2 kept its process";
  EXPECT_NE(survived.finals.at(1).second, survived.firstPids.at(1)) << "rank 1 is a new process";
  EXPECT_NE(survived.err.find("rank(s) 0, 2 re-form in process; 1 worker(s) start as new "
                              "processes"),
            std::string::npos)
      << survived.err;
  EXPECT_NE(survived.err.find("rank 1: survivors of an earlier round re-form with this process"),
            std::string::npos)
      << survived.err;
}

// A second FSDP model in the process (a frozen teacher): no re-formation can
// carry it, so ReformScope(rt, model) does not tell the agent this loop survives; rank 0 says
// why once, every process restarts, and the job still ends as its uninterrupted run does.
TEST(ReformLoop, ASecondFsdpModelRestartsEveryProcessAndSaysWhy) {
  const auto reference = runLoop("auto", 0, {"--second_model"});
  ASSERT_EQ(reference.exitCode, 0) << reference.err;
  const auto run = runLoop("auto", 25, {"--second_model"});
  ASSERT_EQ(run.exitCode, 0) << run.err;
  EXPECT_NE(run.err.find("rank 0: a failure elsewhere restarts this process too: 2 FSDP models "
                         "in this process"),
            std::string::npos)
      << run.err;
  EXPECT_EQ(run.err.find("re-form in process;"), std::string::npos) << run.err;
  for (int rank = 0; rank < 3; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    EXPECT_EQ(run.finals.at(rank).first, reference.finals.at(rank).first) << run.err;
    EXPECT_NE(run.finals.at(rank).second, run.firstPids.at(rank)) << "every process restarted";
  }
}

// A hand-written loop blocked in a wait of its own on the runtime's store (a key no rank writes,
// 60 s) when rank 1 dies: the wait ends with CommAborted on the agent's notice instead of holding
// the re-formation for its timeout, and the survivors re-form in process and end as the
// uninterrupted run, in their own processes.
TEST(ReformLoop, AWaitOnTheStoreEndsWithCommAbortedAndTheSurvivorsReformInProcess) {
  const auto reference = runLoop("auto", 0);
  ASSERT_EQ(reference.exitCode, 0) << reference.err;
  const auto run = runLoop("auto", 25, {"--store_wait"});
  ASSERT_EQ(run.exitCode, 0) << run.err;
  for (const int rank : {0, 2}) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    EXPECT_NE(run.err.find("rank " + std::to_string(rank) +
                           ": the store wait ended: CommAborted: a wait on the store: the round ended"),
              std::string::npos)
        << run.err;
    EXPECT_EQ(run.finals.at(rank).second, run.firstPids.at(rank)) << "kept its process";
  }
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(run.finals.at(rank).first, reference.finals.at(rank).first) << "rank " << rank << "\n" << run.err;
  }
  EXPECT_NE(run.err.find("rank(s) 0, 2 re-form in process; 1 worker(s) start as new processes"), std::string::npos)
      << run.err;
}

// reformDone() and reform() called with no failure anywhere (a loop that calls them on its own
// errors): reformDone() tells the agent nothing, reform() throws ReformError at once (it waited
// for a round that never came, 10 minutes and more) and changes nothing: the job goes on, a
// later kill still re-forms the survivors in process, and every rank ends as the run without
// either call.
TEST(ReformLoop, ReformWithoutAFailureIsRefusedAtOnceAndChangesNothing) {
  const auto reference = runLoop("auto", 0);
  ASSERT_EQ(reference.exitCode, 0) << reference.err;
  const auto run = runLoop("auto", 25, {"--misuse"});
  ASSERT_EQ(run.exitCode, 0) << run.err;
  for (int rank = 0; rank < 3; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    EXPECT_NE(run.err.find("rank " + std::to_string(rank) +
                           ": misuse refused: reform() with no re-formation under way"),
              std::string::npos)
        << run.err;
    EXPECT_EQ(run.finals.at(rank).first, reference.finals.at(rank).first) << run.err;
  }
  EXPECT_EQ(run.err.find("re-formed in process: round 0"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("rank(s) 0, 2 re-form in process; 1 worker(s) start as new processes"),
            std::string::npos)
      << run.err;
  EXPECT_EQ(run.finals.at(0).second, run.firstPids.at(0)) << "rank 0 kept its process";
}

}  // namespace
