// A fsdp::Trainer job whose rank 1 dies after an epoch's evaluation and before the next epoch's
// first step is saved (trainer_epochs_worker.cpp), or in a checkpoint save (last test): the survivors re-form in process and resume at
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

namespace trainer_epochs {  // its own names in a unity batch
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

// mode: "" (no failure), "--kill", "--snapshots", "--kill-in-save" or "--kill-in-async-save"
// (trainer_epochs_worker.cpp).
EpochsRun runEpochs(int examples, const std::string& mode) {
  TempDir dir;
  std::vector<std::string> argv = {kBin + "/fsdprun", "--nproc_per_node", "3", "--max_restarts", "2",
                                   "--restart_mode", "auto", "--rdzv_id", "epochs-" + std::to_string(::getpid()),
                                   kBin + "/trainer_epochs_worker", dir.path(), std::to_string(examples)};
  if (!mode.empty()) argv.push_back(mode);
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
  const auto reference = runEpochs(examples, "");
  ASSERT_EQ(reference.exitCode, 0) << reference.err;
  ASSERT_EQ(reference.evals.size(), 3u) << reference.err;
  const auto run = runEpochs(examples, "--kill");
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

// Rank 1 dies in its checkpoint save of step 5 before it writes its file, while rank 0 waits for
// it in the same save (the others' files are waited for in the store, not in a collective). The
// agent's abort notice ends that wait: rank 0 re-forms with rank 2 in process, at once, not
// after the hang watchdog's bound as a new process; the job ends as the run never stopped does.
void expectTheSaveWaitToEndOnTheNotice(const std::string& mode, const std::string& rankZeroSays = "") {
  SCOPED_TRACE(mode);
  const auto reference = runEpochs(60, "--snapshots");
  ASSERT_EQ(reference.exitCode, 0) << reference.err;
  ASSERT_EQ(reference.evals.size(), 3u) << reference.err;
  const auto run = runEpochs(60, mode);
  ASSERT_EQ(run.exitCode, 0) << run.err;
  EXPECT_NE(run.err.find("rank(s) 0, 2 re-form in process"), std::string::npos) << run.err;
  ASSERT_EQ(run.resumes.size(), 1u) << run.err;
  EXPECT_EQ(run.resumes[0].value("path", ""), "in_process") << run.resumes[0].dump() << "\n" << run.err;
  EXPECT_EQ(run.err.find("has not re-formed"), std::string::npos) << run.err;
  if (!rankZeroSays.empty()) {
    EXPECT_NE(run.err.find(rankZeroSays), std::string::npos) << run.err;
  }
  ASSERT_EQ(run.evals.size(), 3u) << run.err;
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(run.evals[i].value("loss", 0.0), reference.evals[i].value("loss", -1.0)) << "eval line " << i;
  }
  ASSERT_EQ(run.finals.size(), 3u) << run.err;
  EXPECT_EQ(run.finals, reference.finals) << run.err;
}

TEST(ReformTrainer, ARankLostWhileRankZeroWaitsForItsCheckpointFileReformsInProcess) {
  expectTheSaveWaitToEndOnTheNotice("--kill-in-save");
}

// The same with asynchronous checkpoints: rank 0 waits for rank 1's file on its writer thread,
// while its training thread goes on to the next step's collective.
TEST(ReformTrainer, TheSameWhenTheCheckpointIsSavedAsynchronously) {
  expectTheSaveWaitToEndOnTheNotice("--kill-in-async-save",
                                    "rank 0: the checkpoint being written when the world re-formed failed: a wait on "
                                    "the store: the round ended");
}

}  // namespace
}  // namespace trainer_epochs
