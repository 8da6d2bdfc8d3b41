// In-memory snapshots end to end: the real launcher and its keeper, the real mnist trainer (and
// a program on the public Snapshotter API), real SIGKILLs of workers and of a whole agent. Each
// test checks that nothing of the job is left: no process, no /dev/shm entry.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "fsdp/common/process.hpp"
#include "fsdp/launcher/options.hpp"
#include "processes.hpp"
#include "rdzv_daemon.hpp"
#include "run_command.hpp"
#include "summary_line.hpp"

namespace {

namespace fs = std::filesystem;
using fsdp::testing::readFile;
using fsdp::testing::runCommand;
using fsdp::testing::metricsLines;
using fsdp::testing::summaryOf;
using fsdp::testing::TempDir;
using nlohmann::json;
using namespace std::chrono_literals;

const std::string kBin = FSDP_BIN_DIR;
const std::string kData = "/usr/share/datasets/fashion-mnist";
constexpr int kSteps = 40;

bool haveData() { return fs::exists(kData); }


// A run id of its own, so that what the job leaves behind can be found by name.
std::string uniqueRunId(const std::string& what) {
  return "snap-" + what + "-" + std::to_string(::getpid()) + "-" +
         std::to_string(std::chrono::steady_clock::now().time_since_epoch().count() % 1000000);
}

// Nothing of the job is left: no process carrying `tag`, no /dev/shm entry naming `runId`.
void expectNothingLeft(const std::string& tag, const std::string& runId) {
  for (const int pid : fsdp::testing::processesWithEnvironment(tag)) {
    EXPECT_TRUE(fsdp::testing::processGone(pid, 10s)) << "process " << pid << " outlived the job";
  }
  for (const auto& entry : fs::directory_iterator("/dev/shm")) {
    EXPECT_EQ(entry.path().filename().string().find(runId), std::string::npos) << entry.path() << " was left behind";
  }
}

std::vector<std::string> mnist(const std::vector<std::string>& extra, int steps = kSteps) {
  std::vector<std::string> argv = {kBin + "/mnist", "--max_steps", std::to_string(steps), "--no_eval",
                                   "--progress", "none", "--log_every", "1"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

class Snapshots : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!haveData()) return;
    // The uninterrupted run every interrupted one must match, bit for bit.
    auto argv = mnist({});
    argv.insert(argv.begin(), {kBin + "/fsdprun", "--nproc_per_node", "2"});
    const auto r = runCommand(argv, 300s);
    ASSERT_EQ(r.exitCode, 0) << r.err;
    reference_ = summaryOf(r.out);
    ASSERT_TRUE(reference_.contains("params_sha256")) << r.out;
  }
  void SetUp() override {
    if (!haveData()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  static inline json reference_;
};

TEST_F(Snapshots, AWorkerKilledAtARandomStepRedoesAtMostOneStepAndEndsBitIdentical) {
  const char* fixed = std::getenv("SNAPSHOT_SEED");
  const unsigned seed = fixed != nullptr ? static_cast<unsigned>(std::stoul(fixed)) : std::random_device{}();
  std::mt19937 random(seed);
  const int killStep = std::uniform_int_distribution<int>(2, kSteps - 2)(random);
  const int killRank = std::uniform_int_distribution<int>(0, 1)(random);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (SNAPSHOT_SEED replays it): rank " + std::to_string(killRank) +
               " killed after step " + std::to_string(killStep));
  TempDir dir;
  const std::string runId = uniqueRunId("worker");
  const std::string tag = "FSDP_SNAPSHOT_TAG=" + runId;
  auto argv = mnist({"--fault_kill_at_step", std::to_string(killStep), "--fault_kill_rank", std::to_string(killRank),
                     "--metrics_file", dir.path() + "/metrics.jsonl"});
  argv.insert(argv.begin(), {kBin + "/fsdprun", "--nproc_per_node", "2", "--max_restarts", "2", "--rdzv_id", runId});
  const auto r = runCommand(argv, 300s, {tag, "TMPDIR=" + dir.path()});
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.err.find("signal SIGKILL"), std::string::npos) << r.err;  // the failure happened
  const auto summary = summaryOf(r.out);
  EXPECT_EQ(summary.value("resumed_source", ""), "memory") << r.out << r.err;
  // The snapshot of the kill step may or may not have been complete on every rank.
  EXPECT_GE(summary.value("resumed_from_step", -1), killStep - 1) << r.out;
  EXPECT_LE(summary.value("resumed_from_step", -1), killStep) << r.out;
  EXPECT_EQ(summary.value("steps", 0), kSteps);
  EXPECT_EQ(summary.value("params_sha256", ""), reference_["params_sha256"].get<std::string>());
  int resumes = 0;
  for (const auto& line : metricsLines(dir.path() + "/metrics.jsonl")) {
    if (line.value("type", "") != "resume") continue;
    ++resumes;
    EXPECT_EQ(line.value("source", ""), "memory");
    EXPECT_LT(line.value("restore_ms", 1e9), 60000.0);
  }
  EXPECT_EQ(resumes, 1);
  expectNothingLeft(tag, runId);
}

// With snapshots, an asynchronous disk checkpoint is written from the snapshot's memory while
// training goes on (no copy): the checkpoint of step 10, written while steps 11-20 ran, must
// resume (without snapshots) to the uninterrupted run's parameters, bit for bit.
TEST_F(Snapshots, AnAsynchronousCheckpointWrittenFromTheSnapshotHoldsItsStepWhileTrainingGoesOn) {
  TempDir dir;
  const std::string ckpt = dir.path() + "/ckpt";
  const std::string runId = uniqueRunId("frozen");
  const std::string tag = "FSDP_SNAPSHOT_TAG=" + runId;
  auto first = mnist({"--checkpoint_dir", ckpt, "--checkpoint_every", "10", "--async_checkpoint",
                      "--keep_checkpoints", "0"},
                     20);
  first.insert(first.begin(), {kBin + "/fsdprun", "--nproc_per_node", "2", "--max_restarts", "1", "--rdzv_id", runId});
  const auto r = runCommand(first, 300s, {tag});
  ASSERT_EQ(r.exitCode, 0) << r.err;
  ASSERT_TRUE(fs::exists(ckpt + "/step_00000010")) << r.err;
  fs::remove_all(ckpt + "/step_00000020");
  auto second = mnist({"--checkpoint_dir", ckpt, "--snapshot_every", "0"});
  second.insert(second.begin(), {kBin + "/fsdprun", "--nproc_per_node", "2"});
  const auto resumed = runCommand(second, 300s);
  ASSERT_EQ(resumed.exitCode, 0) << resumed.err;
  const auto summary = summaryOf(resumed.out);
  EXPECT_EQ(summary.value("resumed_from_step", -1), 10) << resumed.out;
  EXPECT_EQ(summary.value("params_sha256", ""), reference_["params_sha256"].get<std::string>());
  expectNothingLeft(tag, runId);
}

// NO_SHARD: every rank holds every element, only rank 0 is their primary replica on disk; each
// rank's snapshot still restores it.
TEST_F(Snapshots, UnderNoShardAKilledWorkerResumesFromMemoryBitIdentical) {
  TempDir dir;
  const std::string runId = uniqueRunId("noshard");
  const std::string tag = "FSDP_SNAPSHOT_TAG=" + runId;
  auto plain = mnist({"--sharding", "NO_SHARD"});
  plain.insert(plain.begin(), {kBin + "/fsdprun", "--nproc_per_node", "2"});
  const auto reference = runCommand(plain, 300s);
  ASSERT_EQ(reference.exitCode, 0) << reference.err;
  auto argv = mnist({"--sharding", "NO_SHARD", "--fault_kill_at_step", "17", "--fault_kill_rank", "0"});
  argv.insert(argv.begin(), {kBin + "/fsdprun", "--nproc_per_node", "2", "--max_restarts", "1", "--rdzv_id", runId});
  const auto r = runCommand(argv, 300s, {tag, "TMPDIR=" + dir.path()});
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const auto summary = summaryOf(r.out);
  EXPECT_EQ(summary.value("resumed_source", ""), "memory") << r.out << r.err;
  EXPECT_GE(summary.value("resumed_from_step", -1), 16) << r.out;
  EXPECT_EQ(summary.value("params_sha256", ""), summaryOf(reference.out).value("params_sha256", "?"));
  expectNothingLeft(tag, runId);
}

TEST_F(Snapshots, OverTheMemoryLimitSnapshotsAreSkippedWithAWarningAndDiskIsUsed) {
  TempDir dir;
  const std::string runId = uniqueRunId("limit");
  const std::string tag = "FSDP_SNAPSHOT_TAG=" + runId;
  auto argv = mnist({"--fault_kill_at_step", "13", "--fault_kill_rank", "1", "--checkpoint_dir", dir.path() + "/ckpt",
                     "--checkpoint_every", "5"});
  argv.insert(argv.begin(), {kBin + "/fsdprun", "--nproc_per_node", "2", "--max_restarts", "2", "--rdzv_id", runId,
                             "--snapshot_memory_limit", "4K"});
  const auto r = runCommand(argv, 300s, {tag, "TMPDIR=" + dir.path()});
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.err.find("in-memory snapshots are off for this run"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--snapshot_memory_limit"), std::string::npos) << r.err;
  const auto summary = summaryOf(r.out);
  EXPECT_EQ(summary.value("resumed_source", ""), "disk") << r.out;
  EXPECT_EQ(summary.value("resumed_from_step", -1), 10) << r.out;
  EXPECT_EQ(summary.value("params_sha256", ""), reference_["params_sha256"].get<std::string>());
  expectNothingLeft(tag, runId);
}

TEST(SnapshotUsage, AMalformedMemoryLimitIsAUsageError) {
  const auto r = runCommand({kBin + "/fsdprun", "--max_restarts", "1", "--snapshot_memory_limit", "lots", "true"}, 30s);
  EXPECT_EQ(r.exitCode, 2);
  EXPECT_NE(r.err.find("--snapshot_memory_limit 'lots'"), std::string::npos) << r.err;
}

// The public API without the Trainer: the restored state is the one the step ended with, with
// the optimizer stepping through snapshots.step() (no copy; the state it leaves is frozen while
// training goes on) and through optimizer.step() (the snapshot copies); and, in 3 ranks, with a
// frozen unit (a LoRA-style base: no optimizer state) beside a trainable one. The new processes'
// state lies in the pieces their restore mapped (no copy); with optimizer.step(), rank 1 is
// killed again after its first step: that step, in place, must have left the restored piece as
// it was (the third attempt restores it again, bit for bit).
TEST(SnapshotApi, ARestartRestoresTheStateOfTheNewestCommonStep) {
  struct Variant {
    bool copy, frozenUnit, killAgain;
  };
  for (const auto& [copy, frozenUnit, killAgain] :
       {Variant{false, false, false}, Variant{true, false, true}, Variant{false, true, false}, Variant{true, true, true}}) {
    SCOPED_TRACE(std::string(copy ? "optimizer.step() and a copy" : "snapshots.step()") +
                 (frozenUnit ? ", a frozen unit, 3 ranks" : "") + (killAgain ? ", rank 1 killed again" : ""));
    TempDir dir;
    const std::string runId = uniqueRunId("api");
    const std::string tag = "FSDP_SNAPSHOT_TAG=" + runId;
    std::vector<std::string> argv = {kBin + "/fsdprun", "--nproc_per_node", frozenUnit ? "3" : "2", "--max_restarts",
                                     killAgain ? "2" : "1", "--rdzv_id", runId, kBin + "/snapshot_worker", dir.path(), "12", "7"};
    if (copy) argv.push_back("--copy");
    if (frozenUnit) argv.push_back("--frozen_unit");
    if (killAgain) argv.push_back("--kill_again");
    const auto r = runCommand(argv, 120s, {tag, "TMPDIR=" + dir.path()});
    ASSERT_EQ(r.exitCode, 0) << r.err;
    const auto summary = summaryOf(r.out);
    ASSERT_TRUE(summary.is_object()) << r.out << r.err;
    ASSERT_TRUE(summary["restored"].is_number()) << r.out << r.err;
    // Rank 1 dies with its step 7 held; another rank may still be handing its step 6 to the
    // agent then (its step 7's optimizer step waits for that, and these steps take a
    // millisecond): 5 is seen once in a while under load.
    EXPECT_GE(summary["restored"].get<int>(), 5) << r.err;
    EXPECT_LE(summary["restored"].get<int>(), 7);
    EXPECT_TRUE(summary.value("matches", false)) << "the restored shards or optimizer state differ from step "
                                                 << summary["restored"];
    // Pieces laid out by step() give each shard its whole size; ones written by copying pack the
    // blocks, so a shard with padding (3 ranks: the second unit's 260 elements) is copied there.
    const bool paddedAndPacked = copy && frozenUnit;
    EXPECT_EQ(summary.value("restored_in_place", false), !paddedAndPacked) << "where the restore copied: " << r.out;
    if (killAgain) {
      EXPECT_EQ(fsdp::testing::countOccurrences(r.err, "asked to restart"), 2) << r.err;
    }
    EXPECT_EQ(summary.value("steps", 0), 12);
    if (copy) {
      EXPECT_TRUE(summary["frozen_held"].is_null()) << r.out;
    } else {
      EXPECT_EQ(summary["frozen_held"], true)
          << "the state frozen() vouched for changed afterwards, or the next step stopped writing into a snapshot: "
          << r.out;
    }
    expectNothingLeft(tag, runId);
  }
}

TEST(SnapshotApi, ASnapshotOfAnotherModelIsRefusedWithOneLineAndNothingIsRestored) {
  TempDir dir;
  const std::string runId = uniqueRunId("model");
  const std::string tag = "FSDP_SNAPSHOT_TAG=" + runId;
  const auto r = runCommand({kBin + "/fsdprun", "--nproc_per_node", "2", "--max_restarts", "1", "--rdzv_id", runId,
                             kBin + "/snapshot_worker", dir.path(), "8", "5", "--other_model"},
                            120s, {tag, "TMPDIR=" + dir.path()});
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const auto summary = summaryOf(r.out);
  ASSERT_TRUE(summary.is_object()) << r.out << r.err;
  EXPECT_TRUE(summary["restored"].is_null()) << r.out;
  EXPECT_EQ(fsdp::testing::countOccurrences(r.err, "was refused"), 1) << r.err;
  EXPECT_NE(r.err.find("does not fit this model"), std::string::npos) << r.err;
  expectNothingLeft(tag, runId);
}

// ---- node loss -------------------------------------------------------------------------------


TEST_F(Snapshots, AKilledNodeIsRestoredFromItsPeerCopyAsAOneNodeRunResumedThere) {
  TempDir dir;
  const std::string runId = uniqueRunId("node");
  const std::string tag = "FSDP_SNAPSHOT_TAG=" + runId;
  fsdp::testing::RdzvDaemon daemon;
  std::vector<std::string> env = fsdp::currentEnvironment();
  env.push_back(tag);
  env.push_back("TMPDIR=" + dir.path());
  env.push_back("FSDPRUN_BACKEND=gloo");  // two nodes: no shared memory between them anyway
  const std::string metrics = dir.path() + "/metrics.jsonl";
  std::vector<fsdp::ChildProcess> agents;
  for (int i = 0; i < 2; ++i) {
    std::vector<std::string> argv = {kBin + "/fsdprun", "--nnodes", "1:2", "--nproc_per_node", "1", "--max_restarts",
                                     "2", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                                     "127.0.0.1:" + std::to_string(daemon.port()), "--rdzv_id", runId, "--local_addr",
                                     "127.0.0." + std::to_string(i + 2), "--rdzv_conf",
                                     "is_host=false,heartbeat_interval=0.2,heartbeat_timeout=2,last_call_timeout=1"};
    const auto job = mnist({"--metrics_file", metrics});
    argv.insert(argv.end(), job.begin(), job.end());
    fsdp::SpawnOptions options{.argv = argv, .env = env, .deathSignal = 0};
    options.stdoutPath = dir.path() + "/agent" + std::to_string(i) + ".out";
    options.stderrPath = dir.path() + "/agent" + std::to_string(i) + ".err";
    agents.push_back(fsdp::ChildProcess::spawn(options));
  }
  // Wait (bounded) for step 12, then kill the agent whose worker is rank 1 (with its worker).
  const auto lastStep = [&] {
    long long step = -1;
    for (const auto& line : metricsLines(metrics)) {
      if (line.value("type", "") == "train") step = std::max(step, line["step"].get<long long>());
    }
    return step;
  };
  const auto deadline = std::chrono::steady_clock::now() + 240s;
  while (lastStep() < 12 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(20ms);
  ASSERT_GE(lastStep(), 12) << readFile(dir.path() + "/agent0.err");
  int victim = -1;
  const auto ours = fsdp::testing::processesWithEnvironment(tag);
  for (const int pid : fsdp::testing::processesWithEnvironment("RANK=1")) {
    if (std::find(ours.begin(), ours.end(), pid) == ours.end()) continue;
    const int parent = fsdp::testing::parentOf(pid);
    for (std::size_t i = 0; i < agents.size(); ++i) {
      if (agents[i].pid() == parent) victim = static_cast<int>(i);
    }
  }
  ASSERT_GE(victim, 0) << "no worker of rank 1 under either agent";
  const double killedAt =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  ::kill(agents[static_cast<std::size_t>(victim)].pid(), SIGKILL);
  ASSERT_TRUE(agents[static_cast<std::size_t>(victim)].waitFor(20s).has_value());
  auto& survivor = agents[static_cast<std::size_t>(1 - victim)];
  const auto status = survivor.waitFor(240s);
  ASSERT_TRUE(status.has_value()) << readFile(dir.path() + "/agent" + std::to_string(1 - victim) + ".err");
  const std::string out = readFile(dir.path() + "/agent" + std::to_string(1 - victim) + ".out");
  const std::string err = readFile(dir.path() + "/agent" + std::to_string(1 - victim) + ".err");
  ASSERT_EQ(*status, 0) << err;

  // At most one step redone: the last step completed before the kill, against the one resumed.
  long long doneBeforeKill = -1;
  json resume;
  for (const auto& line : metricsLines(metrics)) {
    if (line.value("type", "") == "train" && line.value("unix_time", 0.0) < killedAt && resume.is_null()) {
      doneBeforeKill = std::max(doneBeforeKill, line["step"].get<long long>());
    }
    if (line.value("type", "") == "resume") resume = line;
  }
  ASSERT_TRUE(resume.is_object()) << "no resume line in " << metrics;
  EXPECT_EQ(resume.value("source", ""), "peer copy") << err;
  const long long resumed = resume["step"].get<long long>();
  EXPECT_GE(resumed, doneBeforeKill - 1) << "more than one step redone";
  const auto summary = summaryOf(out);
  EXPECT_EQ(summary.value("world_size", 0), 1);
  EXPECT_EQ(summary.value("resumed_from_step", -1), resumed);
  EXPECT_EQ(summary.value("steps", 0), kSteps);

  // The state equals what a one-node run resumed from that step holds: a 2-rank run that saves
  // every step, then one rank from its checkpoint of that step.
  const std::string ckpt = dir.path() + "/ckpt";
  auto two = mnist({"--checkpoint_dir", ckpt, "--checkpoint_every", "1", "--keep_checkpoints", "0",
                    "--snapshot_every", "0"},
                   static_cast<int>(resumed));
  two.insert(two.begin(), {kBin + "/fsdprun", "--nproc_per_node", "2"});
  const auto first = runCommand(two, 300s, {"FSDPRUN_BACKEND=gloo", tag});
  ASSERT_EQ(first.exitCode, 0) << first.err;
  auto one = mnist({"--checkpoint_dir", ckpt, "--metrics_file", dir.path() + "/reference.jsonl"});
  one.insert(one.begin(), {kBin + "/fsdprun", "--nproc_per_node", "1"});
  const auto second = runCommand(one, 300s, {"FSDPRUN_BACKEND=gloo", tag});
  ASSERT_EQ(second.exitCode, 0) << second.err;
  const auto reference = summaryOf(second.out);
  EXPECT_EQ(reference.value("resumed_from_step", -1), resumed);
  EXPECT_EQ(summary.value("params_sha256", ""), reference.value("params_sha256", "?"))
      << "the survivor ended elsewhere than one rank resumed from step " << resumed;
  // The loss curve goes on where it was: the first steps after the resume match the reference's.
  std::map<long long, double> lossAfter, referenceLoss;
  bool afterResume = false;
  for (const auto& line : metricsLines(metrics)) {
    if (line.value("type", "") == "resume") afterResume = true;
    if (afterResume && line.value("type", "") == "train") lossAfter[line["step"]] = line["loss"];
  }
  for (const auto& line : metricsLines(dir.path() + "/reference.jsonl")) {
    if (line.value("type", "") == "train") referenceLoss[line["step"]] = line["loss"];
  }
  ASSERT_TRUE(lossAfter.contains(resumed + 1));
  EXPECT_EQ(lossAfter[resumed + 1], referenceLoss[resumed + 1]);
  expectNothingLeft(tag, runId);
}

}  // namespace

namespace {

// The JSON lines standby_worker printed, by (restart, rank).
std::map<std::pair<int, int>, json> standbyLines(const std::string& out) {
  std::map<std::pair<int, int>, json> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    const auto brace = line.find("{\"rank\"");
    if (brace == std::string::npos) continue;
    const auto j = json::parse(line.substr(brace), nullptr, false);
    if (j.is_object()) lines[{j["restart"].get<int>(), j["rank"].get<int>()}] = j;
  }
  return lines;
}

}  // namespace

// --standby: the spares started while the job runs are the workers of the restart (their pids,
// started before the failure, are the restarted ranks'), and the spares of a restart that never
// comes go with the job.
TEST(Standby, TheSparesStartedAheadBecomeTheRestartedWorkersAndUnusedOnesGoWithTheJob) {
  const std::string runId = uniqueRunId("standby");
  const std::string tag = "FSDP_TEST_STANDBY=" + runId;
  const auto r = runCommand({kBin + "/fsdprun", "--standby", "--nproc_per_node", "2", "--max_restarts", "2",
                             "--rdzv_id", runId, kBin + "/standby_worker"},
                            180s, {tag});
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  const auto lines = standbyLines(r.out);
  ASSERT_TRUE(lines.contains({0, 1}) && lines.contains({1, 0}) && lines.contains({1, 1})) << r.out << r.err;
  EXPECT_FALSE(lines.at({0, 1})["standby"].get<bool>());
  // Restart 1's rank 1 is the very process rank 1 saw waiting before it died.
  EXPECT_EQ(lines.at({1, 1})["pid"], lines.at({0, 1})["next_standby"]) << r.out;
  EXPECT_TRUE(lines.at({1, 1})["standby"].get<bool>());
  EXPECT_TRUE(lines.at({1, 0})["standby"].get<bool>());
  // Restart 1 saw the spares of restart 2 up; the job ended without using them.
  const int unused = lines.at({1, 1})["next_standby"].get<int>();
  ASSERT_GT(unused, 0);
  EXPECT_TRUE(fsdp::testing::processGone(unused, 10s)) << "the unused standby " << unused << " outlived the job";
  expectNothingLeft(tag, runId);
}

// A spare that exits while it waits (here its program fails before fsdp::init(); an OOM kill or
// a crash look the same) is named at once, with how it ended and its last stderr line: the
// restart that would have used it starts a new process, and nothing else would say why.
TEST(Standby, ASpareThatExitsWhileItWaitsIsNamedWithItsLastWordsAndTheRestartStartsANewProcess) {
  const std::string runId = uniqueRunId("standby-exits");
  const std::string tag = "FSDP_TEST_STANDBY=" + runId;
  TempDir dir;
  const auto r = runCommand({kBin + "/fsdprun", "--standby", "--nproc_per_node", "2", "--max_restarts", "1",
                             "--rdzv_id", runId, kBin + "/standby_worker"},
                            180s, {tag, "STANDBY_WORKER_SPARES_FAIL=" + dir.path()});
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  const auto lines = standbyLines(r.out);
  ASSERT_TRUE(lines.contains({0, 1}) && lines.contains({1, 0}) && lines.contains({1, 1})) << r.out << r.err;
  const int spare = lines.at({0, 1})["next_standby"].get<int>();
  ASSERT_GT(spare, 0) << r.out;
  EXPECT_NE(r.err.find("--standby: the spare of rank 1 (pid " + std::to_string(spare) +
                       ") exited while it waited (exit code 4): standby_worker: this spare cannot start"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(lines.at({1, 1})["standby"].get<bool>()) << r.out;
  EXPECT_FALSE(lines.at({1, 0})["standby"].get<bool>()) << r.out;
  expectNothingLeft(tag, runId);
}

TEST(Standby, ProgramsThatCannotWaitInInitAreUsageErrorsNamingTheFlag) {
  const auto noRestarts = runCommand({kBin + "/fsdprun", "--standby", kBin + "/standby_worker"}, 30s);
  EXPECT_EQ(noRestarts.exitCode, 2);
  EXPECT_NE(noRestarts.err.find("--standby with --max_restarts 0"), std::string::npos) << noRestarts.err;
  const auto notOurs = runCommand({kBin + "/fsdprun", "--standby", "--max_restarts", "1", "/bin/true"}, 30s);
  EXPECT_EQ(notOurs.exitCode, 2);
  EXPECT_NE(notOurs.err.find("'/bin/true' does not use libfsdp"), std::string::npos) << notOurs.err;
  TempDir dir;
  std::ofstream(dir.path() + "/train.py") << "print('hello')\n";
  const auto python =
      runCommand({kBin + "/fsdprun", "--standby", "--max_restarts", "1", dir.path() + "/train.py"}, 30s);
  EXPECT_EQ(python.exitCode, 2);
  EXPECT_NE(python.err.find("runs under Python"), std::string::npos) << python.err;
  EXPECT_TRUE(fsdp::launcher::usesLibfsdp(kBin + "/mnist"));
  EXPECT_FALSE(fsdp::launcher::usesLibfsdp("/bin/true"));
}
