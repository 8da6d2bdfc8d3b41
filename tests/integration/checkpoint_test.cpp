// Checkpoints and elastic resume end to end: the real launcher, the real mnist trainer, real
// SIGKILLs, Python's torch.load; and the Trainer's metrics file and plot.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "fsdp/common/process.hpp"
#include "processes.hpp"
#include "run_command.hpp"
#include "summary_line.hpp"

namespace {

namespace fs = std::filesystem;
using fsdp::testing::countOccurrences;
using fsdp::testing::readFile;
using fsdp::testing::runCommand;
using fsdp::testing::summaryOf;
using fsdp::testing::TempDir;
using namespace std::chrono_literals;

const std::string kBin = FSDP_BIN_DIR;
const std::string kData = "/usr/share/datasets/fashion-mnist";

bool haveData() { return fs::exists(kData); }

// The last line of rank 0's output: the summary JSON.
std::vector<std::string> mnistJob(const std::string& ckptDir, const std::vector<std::string>& launcher,
                                  const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {kBin + "/fsdprun"};
  argv.insert(argv.end(), launcher.begin(), launcher.end());
  for (const auto& a : std::vector<std::string>{kBin + "/mnist", "--max_steps", "60", "--checkpoint_dir", ckptDir,
                                                "--checkpoint_every", "10", "--no_eval", "--progress", "none"}) {
    argv.push_back(a);
  }
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

// The newest committed step in a checkpoint directory, or -1.
long long newestStep(const std::string& dir) {
  long long best = -1;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("step_") && fs::exists(e.path() / "COMMIT")) best = std::max(best, std::stoll(name.substr(5)));
  }
  return best;
}

class Resume : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!haveData()) return;
    // The uninterrupted run every interrupted one must match, bit for bit.
    TempDir dir;
    const auto r = runCommand(mnistJob(dir.path(), {"--nproc_per_node", "2"}, {}), 300s);
    ASSERT_EQ(r.exitCode, 0) << r.err;
    reference_ = summaryOf(r.out);
    ASSERT_TRUE(reference_.contains("params_sha256")) << r.out;
  }
  void SetUp() override {
    if (!haveData()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  static inline nlohmann::json reference_;
};

TEST_F(Resume, ARankKilledAtStep37RestartsFromStep30AndEndsBitIdentical) {
  TempDir dir;
  const auto r = runCommand(mnistJob(dir.path(), {"--nproc_per_node", "2", "--max_restarts", "3"},
                                     {"--fault_kill_at_step", "37", "--fault_kill_rank", "1", "--snapshot_every", "0"}),
                            300s);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.err.find("signal SIGKILL"), std::string::npos) << r.err;  // the failure happened
  const auto summary = summaryOf(r.out);
  EXPECT_EQ(summary.value("resumed_from_step", -1), 30) << r.out;
  EXPECT_EQ(summary.value("steps", 0), 60);
  EXPECT_EQ(summary.value("params_sha256", ""), reference_["params_sha256"].get<std::string>());
}

TEST_F(Resume, AKilledLauncherRerunWithTheSameCommandEndsBitIdentical) {
  TempDir dir;
  const auto argv = mnistJob(dir.path(), {"--nproc_per_node", "2"}, {});
  {
    fsdp::SpawnOptions options{.argv = argv, .env = fsdp::currentEnvironment(), .deathSignal = 0};
    options.stdoutPath = dir.path() + "/first.out";
    options.stderrPath = dir.path() + "/first.err";
    auto launcher = fsdp::ChildProcess::spawn(options);
    // Wait (bounded) for a checkpoint past the first few; files are the only signal there is.
    const auto deadline = std::chrono::steady_clock::now() + 240s;
    while (newestStep(dir.path()) < 30 && std::chrono::steady_clock::now() < deadline && !launcher.tryWait()) {
      std::this_thread::sleep_for(50ms);
    }
    ASSERT_GE(newestStep(dir.path()), 30) << readFile(dir.path() + "/first.err");
    ::kill(launcher.pid(), SIGKILL);  // the launcher alone: its workers must go with it
    ASSERT_TRUE(launcher.waitFor(20s).has_value());
  }
  const long long saved = newestStep(dir.path());
  const auto r = runCommand(argv, 300s);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const auto summary = summaryOf(r.out);
  EXPECT_GE(summary.value("resumed_from_step", -1), saved) << r.out;
  EXPECT_EQ(summary.value("params_sha256", ""), reference_["params_sha256"].get<std::string>());
}

// The loss of every logged step of a metrics file.
std::map<long long, double> losses(const std::string& path) {
  std::map<long long, double> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.value("type", "") == "train") out[j["step"].get<long long>()] = j["loss"].get<double>();
  }
  return out;
}

TEST_F(Resume, TwoRanksCheckpointThenFourAndOneContinueTheSameLoss) {
  TempDir dir;
  const std::string base = dir.path() + "/two";
  const auto train = [&](const std::string& ckpt, int ranks, int steps, const std::string& metrics) {
    return runCommand({kBin + "/fsdprun", "--nproc_per_node", std::to_string(ranks), kBin + "/mnist", "--max_steps",
                       std::to_string(steps), "--checkpoint_dir", ckpt, "--no_dropout", "--no_eval", "--log_every",
                       "1", "--metrics_file", metrics, "--progress", "none"},
                      600s);
  };
  ASSERT_EQ(train(base, 2, 20, dir.path() + "/first.jsonl").exitCode, 0);
  for (const char* copy : {"/one", "/four"}) fs::copy(base, dir.path() + copy, fs::copy_options::recursive);
  const auto two = train(base, 2, 35, dir.path() + "/two.jsonl");
  ASSERT_EQ(two.exitCode, 0) << two.err;
  const auto four = train(dir.path() + "/four", 4, 35, dir.path() + "/four.jsonl");
  ASSERT_EQ(four.exitCode, 0) << four.err;
  const auto one = train(dir.path() + "/one", 1, 35, dir.path() + "/one.jsonl");
  ASSERT_EQ(one.exitCode, 0) << one.err;
  EXPECT_EQ(summaryOf(four.out).value("resumed_from_step", -1), 20);
  const auto reference = losses(dir.path() + "/two.jsonl");
  ASSERT_EQ(reference.size(), 15u);  // steps 21..35, appended after the first run's
  for (const auto& [name, curve] : {std::pair{"four", losses(dir.path() + "/four.jsonl")},
                                    std::pair{"one", losses(dir.path() + "/one.jsonl")}}) {
    for (const auto& [step, loss] : reference) {
      ASSERT_TRUE(curve.contains(step)) << name << " step " << step;
      // fp32: the same sums in another order (other shard boundaries) for 35 Adam steps.
      EXPECT_NEAR(curve.at(step), loss, 1e-4 * std::max(1.0, std::abs(loss))) << name << " step " << step;
    }
  }
}

// CKPT_KILL_TRIALS (default 12, CI's budget) and CKPT_KILL_SEED (default 20261123) choose the
// kills; `make checkpoint-kills CKPT_KILL_TRIALS=200` runs a long series from a random seed. A
// failure prints both.
TEST(CheckpointSave, SigkillAtRandomPointsOfSavesNeverLeavesAnUnloadableNewestCheckpoint) {
  TempDir dir;
  const char* trialsEnv = std::getenv("CKPT_KILL_TRIALS");
  const char* seedEnv = std::getenv("CKPT_KILL_SEED");
  const int trials = trialsEnv != nullptr ? std::stoi(trialsEnv) : 12;
  const auto seed = seedEnv != nullptr ? static_cast<std::uint32_t>(std::stoul(seedEnv)) : 20261123U;
  SCOPED_TRACE("CKPT_KILL_SEED=" + std::to_string(seed) + " CKPT_KILL_TRIALS=" + std::to_string(trials));
  std::mt19937 random(seed);
  // A save of the writer's 50 MB takes tens of milliseconds; kills land before, inside and
  // after the writes, fsyncs, the rename and the pruning.
  std::uniform_int_distribution<int> delay(0, 150);
  for (int trial = 0; trial < trials; ++trial) {
    const std::string out = dir.path() + "/writer" + std::to_string(trial) + ".out";
    fsdp::SpawnOptions options{.argv = {kBin + "/ckpt_writer", dir.path(), "save"}, .env = fsdp::currentEnvironment()};
    options.stdoutPath = out;
    options.stderrPath = dir.path() + "/writer.err";
    auto writer = fsdp::ChildProcess::spawn(options);
    // Once it saves back to back (its output is the only signal), a random moment later.
    const auto deadline = std::chrono::steady_clock::now() + 120s;
    while (readFile(out).find("committed") == std::string::npos && std::chrono::steady_clock::now() < deadline &&
           !writer.tryWait()) {
      std::this_thread::sleep_for(20ms);
    }
    ASSERT_NE(readFile(out).find("committed"), std::string::npos) << readFile(dir.path() + "/writer.err");
    std::this_thread::sleep_for(std::chrono::milliseconds(delay(random)));
    writer.signal(SIGKILL);
    writer.waitFor(10s);
    const auto check = runCommand({kBin + "/ckpt_writer", dir.path(), "verify"}, 60s);
    EXPECT_EQ(check.exitCode, 0) << "trial " << trial << ": " << check.err;
    const auto inspect = runCommand({kBin + "/fsdp-ckpt", "inspect", dir.path()}, 60s);
    EXPECT_EQ(inspect.exitCode, 0) << "trial " << trial << ": " << inspect.err;
  }
}

// Slurm's warning before the time limit (`--signal=USR1@90`) reaches fsdprun, which forwards
// it; every rank checkpoints after the step in progress and trains on.
TEST(CheckpointSave, SigusrOneToTheLauncherMakesEveryRankCheckpointAndGoOn) {
  if (!haveData()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir dir;
  const std::string metrics = dir.path() + "/metrics.jsonl";
  fsdp::SpawnOptions options{.argv = {kBin + "/fsdprun", "--nproc_per_node", "2", kBin + "/mnist", "--max_steps",
                                      "100000", "--checkpoint_dir", dir.path() + "/ckpt", "--no_eval", "--log_every",
                                      "2", "--metrics_file", metrics, "--progress", "lines"},
                             .env = fsdp::currentEnvironment(),
                             .deathSignal = 0};
  options.stdoutPath = dir.path() + "/out";
  options.stderrPath = dir.path() + "/err";
  auto launcher = fsdp::ChildProcess::spawn(options);
  const auto waitFor = [&](const std::function<bool()>& done) {
    const auto deadline = std::chrono::steady_clock::now() + 180s;
    while (!done() && std::chrono::steady_clock::now() < deadline && !launcher.tryWait()) {
      std::this_thread::sleep_for(50ms);  // files are the only signal there is
    }
    return done();
  };
  ASSERT_TRUE(waitFor([&] { return readFile(metrics).find("\"step\":4") != std::string::npos; }))
      << readFile(dir.path() + "/err");
  ::kill(launcher.pid(), SIGUSR1);
  ASSERT_TRUE(waitFor([&] { return newestStep(dir.path() + "/ckpt") > 0; })) << readFile(dir.path() + "/err");
  const long long saved = newestStep(dir.path() + "/ckpt");
  // It trains on after the checkpoint.
  const auto lastStep = [&] {
    long long last = 0;
    std::istringstream lines(readFile(metrics));
    std::string line;
    while (std::getline(lines, line)) {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.contains("step")) last = std::max(last, j["step"].get<long long>());
    }
    return last;
  };
  EXPECT_TRUE(waitFor([&] { return lastStep() >= saved + 4; })) << lastStep() << " " << saved;
  ::kill(launcher.pid(), SIGTERM);
  const auto status = launcher.waitFor(60s);
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 128 + SIGTERM) << fsdp::describeWaitStatus(*status);
  EXPECT_NE(readFile(dir.path() + "/out").find("checkpoint requested by signal 10: saving step " + std::to_string(saved)),
            std::string::npos);
  EXPECT_EQ(runCommand({kBin + "/fsdp-ckpt", "inspect", dir.path() + "/ckpt"}, 60s).exitCode, 0);
}

TEST(FullCheckpoint, ConsolidatedLoadsInPythonAndGivesTheSameTestAccuracy) {
  if (!haveData()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  if (!fsdp::testing::systemPythonHasTorch()) GTEST_SKIP() << "python3-torch is not installed";
  TempDir dir;
  const auto r = runCommand({kBin + "/fsdprun", "--nproc_per_node", "2", kBin + "/mnist", "--max_steps", "30",
                             "--checkpoint_dir", dir.path(), "--progress", "none"},
                            300s);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const double ours = summaryOf(r.out).value("test_accuracy", -1.0);
  const auto consolidate = runCommand({kBin + "/fsdp-ckpt", "consolidate", dir.path(), dir.path() + "/full.pt"}, 60s);
  ASSERT_EQ(consolidate.exitCode, 0) << consolidate.err;
  const auto python = runCommand({fsdp::testing::kSystemPython, std::string(FSDP_SOURCE_DIR) + "/tests/integration/python/mnist_eval.py",
                                  dir.path() + "/full.pt"},
                                 300s);
  ASSERT_EQ(python.exitCode, 0) << python.err;
  const auto result = nlohmann::json::parse(python.out);
  EXPECT_EQ(result["parameters"].get<int>(), 8);
  // The same weights on the same 10,000 images: at most a rounding tie may flip.
  EXPECT_NEAR(result["test_accuracy"].get<double>(), ours, 2e-4) << python.out << r.out;
  EXPECT_GT(ours, 0.6);
}

TEST(CorruptCheckpoint, IsRefusedNamingTheFileAndNothingIsOverwritten) {
  if (!haveData()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir dir;
  const auto train = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> argv = {kBin + "/fsdprun", "--nproc_per_node", "2", kBin + "/mnist", "--max_steps", "5",
                                     "--checkpoint_dir", dir.path(), "--no_eval", "--progress", "none"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return runCommand(argv, 300s);
  };
  ASSERT_EQ(train({}).exitCode, 0);
  const std::string ckpt = dir.path() + "/step_00000005";
  const auto listing = [&] {
    std::map<std::string, std::uintmax_t> files;
    for (const auto& e : fs::recursive_directory_iterator(dir.path())) {
      if (e.is_regular_file()) files[e.path().string()] = e.file_size();
    }
    return files;
  };
  // Another model: named by its first mismatching parameter.
  auto before = listing();
  auto r = train({"--model", "deep"});
  EXPECT_EQ(r.exitCode, 1) << r.err;
  EXPECT_NE(r.err.find("does not fit this model: parameter 'fc1.weight' has shape [128, 9216] there but [9000, 9216] here"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(listing(), before);
  // A truncated shard.
  fs::resize_file(ckpt + "/rank_00001.bin", 1000);
  before = listing();
  r = train({});
  EXPECT_EQ(r.exitCode, 1);
  EXPECT_NE(r.err.find(ckpt + "/rank_00001.bin has 1000 bytes"), std::string::npos) << r.err;
  EXPECT_EQ(listing(), before);
  // Missing metadata.
  fs::remove(ckpt + "/metadata.json");
  before = listing();
  r = train({});
  EXPECT_EQ(r.exitCode, 1);
  EXPECT_NE(r.err.find(ckpt + "/metadata.json is missing"), std::string::npos) << r.err;
  EXPECT_EQ(listing(), before);
  const auto inspect = runCommand({kBin + "/fsdp-ckpt", "inspect", ckpt}, 60s);
  EXPECT_EQ(inspect.exitCode, 2);
  EXPECT_NE(inspect.err.find("metadata.json is missing"), std::string::npos) << inspect.err;
}

TEST(Metrics, TheJsonlIsOneObjectPerLineAndThePlotIsDrawn) {
  if (!haveData()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir dir;
  const std::string metrics = dir.path() + "/metrics.jsonl";
  const auto r = runCommand({kBin + "/fsdprun", "--nproc_per_node", "2", kBin + "/mnist", "--max_steps", "20",
                             "--log_every", "5", "--metrics_file", metrics, "--progress", "lines"},
                            300s);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_EQ(countOccurrences(r.out, "train step "), 4) << r.out;
  std::ifstream in(metrics);
  std::string line;
  int train = 0, eval = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << "not JSON: " << line;
    ASSERT_TRUE(j.is_object()) << line;
    if (j["type"] == "train") {
      ++train;
      for (const char* key : {"step", "epoch", "loss", "lr", "samples_per_s", "step_time_ms", "peak_rss_mb"}) {
        EXPECT_TRUE(j.contains(key)) << key << " missing in " << line;
      }
    } else if (j["type"] == "eval") {
      ++eval;
      EXPECT_TRUE(j.contains("accuracy")) << line;
    }
  }
  EXPECT_EQ(train, 4);
  EXPECT_EQ(eval, 1);
  for (const char* ext : {".png", ".svg"}) {
    const std::string out = dir.path() + "/curves" + ext;
    const auto plot = runCommand({kBin + "/fsdp-plot", metrics, out}, 60s);
    ASSERT_EQ(plot.exitCode, 0) << plot.err;
    const std::string bytes = readFile(out);
    if (std::string(ext) == ".png") {
      EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
      EXPECT_GT(bytes.size(), 10000u);
    } else {
      EXPECT_NE(bytes.find("<svg"), std::string::npos);
    }
  }
  const auto bad = runCommand({kBin + "/fsdp-plot", metrics, dir.path() + "/curves.gif"}, 60s);
  EXPECT_EQ(bad.exitCode, 2);
}

}  // namespace
