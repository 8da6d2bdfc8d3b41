// A fsdp::Trainer job whose rank 1 dies after an epoch's evaluation and before the next epoch's
// first step is saved (trainer_epochs_worker.cpp): the survivors re-form in process and resume at
// that epoch's end, where rank 0, which wrote the evaluation's lines, is still there. Every epoch
// is evaluated once in the metrics, with the values of a run never stopped, and the job ends as
// that run does.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "run_command.hpp"
#include "summary_line.hpp"

namespace {

using fsdp::testing::metricsLines;
using fsdp::testing::readFile;
using fsdp::testing::runCommand;
using fsdp::testing::TempDir;
using nlohmann::json;
using namespace std::chrono_literals;

const std::string kBin = FSDP_BIN_DIR;

struct EpochsRun {
  int exitCode = -1;
  std::string err;
  std::vector<json> evals;             // the metrics' eval lines, in order
  std::vector<json> resumes;           // the metrics' resume lines
  std::map<int, std::string> finals;   // rank -> state hash
};

EpochsRun runEpochs(int examples, bool kill) {
  TempDir dir;
  std::vector<std::string> argv = {kBin + "/fsdprun", "--nproc_per_node", "3", "--max_restarts", "2",
                                   "--restart_mode", "auto", "--rdzv_id", "epochs-" + std::to_string(::getpid()),
                                   kBin + "/trainer_epochs_worker", dir.path(), std::to_string(examples)};
  if (kill) argv.push_back("--kill");
  const auto r = runCommand(argv, 240s, {"TMPDIR=" + dir.path()});
  EpochsRun run{r.exitCode, r.err, {}, {}, {}};
  for (const auto& line : metricsLines(dir.path() + "/metrics.jsonl")) {
    if (line.value("type", "") == "eval") run.evals.push_back(line);
    if (line.value("type", "") == "resume") run.resumes.push_back(line);
  }
  for (int rank = 0; rank < 3; ++rank) {
    std::istringstream final(readFile(dir.path() + "/final_" + std::to_string(rank)));
    std::string hash;
    if (final >> hash) run.finals[rank] = hash;
  }
  return run;
}

// The survivors come back to the checkpoint of step 5, epoch 1's last: with 60 examples it says
// that epoch 2 starts (the Trainer evaluates epoch 1 before it), with 61 that epoch 1's left-out
// last batch comes next (the loop's epoch end evaluates it). Either way epoch 1 was evaluated
// before the kill, by rank 0, which survives.
void expectOneEvaluationPerEpoch(int examples) {
  SCOPED_TRACE(std::to_string(examples) + " examples");
  const auto reference = runEpochs(examples, false);
  ASSERT_EQ(reference.exitCode, 0) << reference.err;
  ASSERT_EQ(reference.evals.size(), 3u) << reference.err;
  const auto run = runEpochs(examples, true);
  ASSERT_EQ(run.exitCode, 0) << run.err;
  ASSERT_EQ(run.resumes.size(), 1u) << run.err;
  EXPECT_EQ(run.resumes[0].value("step", -1), 5) << run.resumes[0].dump();
  EXPECT_EQ(run.resumes[0].value("path", ""), "in_process") << run.resumes[0].dump();
  EXPECT_NE(run.err.find("rank(s) 0, 2 re-form in process"), std::string::npos) << run.err;
  ASSERT_EQ(run.evals.size(), 3u) << "epoch 1 evaluated twice?\n" << run.err;
  for (std::size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE("eval line " + std::to_string(i));
    EXPECT_EQ(run.evals[i].value("epoch", 0), static_cast<int>(i) + 1);
    EXPECT_EQ(run.evals[i].value("step", 0), reference.evals[i].value("step", -1));
    EXPECT_EQ(run.evals[i].value("loss", 0.0), reference.evals[i].value("loss", -1.0));
    EXPECT_EQ(run.evals[i].value("accuracy", 0.0), reference.evals[i].value("accuracy", -1.0));
  }
  ASSERT_EQ(run.finals.size(), 3u) << run.err;
  EXPECT_EQ(run.finals, reference.finals) << run.err;
}

TEST(ReformTrainer, AnEpochEvaluatedBeforeTheFailureIsNotEvaluatedAgainWhereRankZeroSurvives) {
  expectOneEvaluationPerEpoch(60);
}

TEST(ReformTrainer, TheSameWhenTheEpochEndsWithALeftOutBatch) { expectOneEvaluationPerEpoch(61); }

}  // namespace
