#pragma once
// The training loop users write against: fit() trains a wrapped model on a dataset for some
// epochs or steps, evaluates after every epoch, reports metrics reduced over every rank, saves
// checkpoints on a cadence and resumes from the newest one. Rank 0 prints a live progress bar
// on a terminal (rate, ETA, loss), plain periodic lines otherwise (logs, Slurm), and writes a
// JSONL metrics file.
//
//   fsdp::Trainer trainer(*rt, model, optimizer, fsdp::Trainer::crossEntropy(),
//                         {.epochs = 1, .globalBatch = 256, .metricsFile = "metrics.jsonl"});
//   const auto result = trainer.fit(trainData, &testData);
//
// Every rank calls fit() with the same options and datasets of the same size; each rank trains
// on its slice of every global batch (DistributedSampler), so N ranks train like one process
// with the same global batch.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "fsdp/worker/checkpoint.hpp"
#include "fsdp/worker/data.hpp"
#include "fsdp/worker/fsdp.hpp"
#include "fsdp/worker/snapshot.hpp"

namespace torch::optim {
class Optimizer;
}

namespace fsdp::worker {

class Runtime;

enum class ProgressStyle {
  kAuto,   // a bar when stdout is a terminal, lines otherwise
  kBar,
  kLines,
  kNone,
};

struct TrainerOptions {
  int epochs = 1;
  std::int64_t maxSteps = 0;     // stop after this many optimizer steps in all (0: no limit)
  std::int64_t globalBatch = 64; // examples per optimizer step, over all ranks
  int gradAccumulation = 1;      // micro-batches per step (gradients reduced once per step)
  double clipGradNorm = 0;       // clip the global gradient norm to this (0: off)
  // The learning rate of step `step` (counted from 0), set on every parameter group before the
  // step; empty: the optimizer's own.
  std::function<double(std::int64_t step)> lrSchedule;
  std::uint64_t seed = 0;        // data order and, per rank, the RNG (dropout)
  bool shuffle = true;
  LastBatch lastBatch = LastBatch::kPartial;
  std::int64_t evalBatch = 0;    // examples per evaluation step over all ranks (0: 4 x globalBatch)
  bool evaluateEveryEpoch = true;
  std::int64_t evalEvery = 0;    // also evaluate every N steps (0: epochs and the end only)
  bool accuracy = false;         // classification: count argmax(output, 1) == target
  int logEvery = 50;             // steps between metric lines (and plain progress lines)
  std::string metricsFile;       // JSONL written by rank 0 (appended to when resuming)
  ProgressStyle progress = ProgressStyle::kAuto;
  std::string checkpointDir;     // resume from the newest checkpoint here; save here
  int checkpointEvery = 0;       // steps between checkpoints (0: only the last step)
  int keepCheckpoints = 3;
  bool asyncCheckpoint = false;
  // With a checkpoint directory: this signal (Slurm's `--signal=USR1@90` warning before the
  // time limit, forwarded by fsdprun) makes every rank checkpoint after the step in progress,
  // then go on. 0: off. Installed only where the program left the signal at its default.
  int checkpointSignal = 10;  // SIGUSR1
  int prefetch = 2;              // batches prepared ahead on the loader's thread
  // Steps between in-memory snapshots held by the agent (0: off). A restart resumes from the
  // newest one every rank holds before looking at disk checkpoints. Kept only under fsdprun
  // with --max_restarts > 0 (see snapshot.hpp); the copy overlaps the next step.
  int snapshotEvery = 1;
};

struct EvalResult {
  double loss = 0;
  double accuracy = 0;  // when TrainerOptions::accuracy
  std::int64_t samples = 0;
};

inline constexpr std::int64_t kWarmupSteps = 2;

struct FitResult {
  std::int64_t steps = 0;          // optimizer steps done in all (resumed ones included)
  std::optional<std::int64_t> resumedFrom;  // the checkpoint's step, when the run resumed
  std::string resumedSource;       // "memory", "peer copy" (snapshots) or "disk"
  double trainLoss = 0;            // mean over the last logging interval
  EvalResult eval;                 // the last evaluation
  double samplesPerSecond = 0;     // over this process's training time
  // Over the steps after the first kWarmupSteps of this run (0 when there were none): the rate
  // a long run settles at, without the first steps' one-time costs (every buffer touched for
  // the first time, optimizer state created).
  double steadySamplesPerSecond = 0;
  double tokensPerSecond = 0;
  double peakRssMb = 0;            // the largest of the ranks
  // In-process re-formations this process went through (fsdprun --restart_mode auto): a failure
  // elsewhere cost it the step in progress, not its life (reform.hpp).
  int reforms = 0;
};

class Trainer {
 public:
  // The mean loss of a micro-batch (its examples on this rank).
  using LossFn = std::function<at::Tensor(const at::Tensor& output, const Batch& batch)>;
  // Runs the model on a batch (default: model->forward(batch.input)).
  using ForwardFn = std::function<at::Tensor(FullyShardedDataParallel& model, const Batch& batch)>;

  // `runtime`, `model` and `optimizer` must outlive the trainer. Throws ConfigError for bad
  // options (naming them).
  Trainer(Runtime& runtime, FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer,
          LossFn loss, TrainerOptions options);
  ~Trainer();

  // Collective. Trains, evaluating on `eval` (if given) after every epoch and at the end.
  // Under fsdprun --restart_mode auto, a failure of another worker is survived here: the
  // step in progress is dropped, the world re-forms in process and training resumes from the
  // newest snapshot every rank holds (reform.hpp).
  FitResult fit(const Dataset& train, const Dataset* eval = nullptr);
  // Collective. The mean loss (and accuracy) over every example of `data`.
  EvalResult evaluate(const Dataset& data);

  // Called on every rank after every optimizer step, with the step count (1 for the first).
  std::function<void(std::int64_t step)> afterStep;
  ForwardFn forward;

  // Losses for the common cases.
  static LossFn crossEntropy();  // logits [N, C] (or [N, T, C]) and class targets
  static LossFn nllLoss();       // log-probabilities [N, C] and class targets

 private:
  struct Impl;
  // fit() from the resume on, once per round this process lives through.
  FitResult fitRound(const Dataset& train, const Dataset* eval, const struct ReformInfo* reformed, int reforms);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp::worker

namespace fsdp {
using worker::EvalResult;
using worker::FitResult;
using worker::ProgressStyle;
using worker::Trainer;
using worker::TrainerOptions;
}  // namespace fsdp
