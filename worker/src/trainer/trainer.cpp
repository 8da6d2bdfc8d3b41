#include "fsdp/worker/trainer.hpp"

#include <ATen/Functions.h>
#include <signal.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/optimizer.h>
#include <torch/utils.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"
#include "comm/recorded_communicator.hpp"
#include "fsdp/worker/flight_recorder.hpp"
#include "fsdp/worker/reform.hpp"
#include "fsdp/worker/runtime.hpp"
#include "trainer/trainer_impl.hpp"
#include "trainer/trainer_output.hpp"
#include "fsdp/common/log.hpp"

namespace fsdp::worker {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;
using detail::CheckpointSignal;
using detail::clock;
using detail::emitLine;
using detail::rate;
using detail::unixTime;

}  // namespace

Trainer::Trainer(Runtime& runtime, FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer,
                 LossFn loss, TrainerOptions options)
    : impl_(std::make_unique<Impl>(runtime, model, optimizer, std::move(loss), std::move(options))) {
  const auto& o = impl_->options;
  if (o.epochs < 1) throw ConfigError("--epochs " + std::to_string(o.epochs) + ": expected at least 1");
  if (o.maxSteps < 0) throw ConfigError("--max_steps " + std::to_string(o.maxSteps) + ": expected 0 or more");
  if (o.gradAccumulation < 1) {
    throw ConfigError("gradient accumulation " + std::to_string(o.gradAccumulation) + ": expected at least 1");
  }
  if (o.globalBatch < static_cast<std::int64_t>(runtime.worldSize()) * o.gradAccumulation) {
    throw ConfigError("--batch_size " + std::to_string(o.globalBatch) + ": must be at least the world size (" +
                      std::to_string(runtime.worldSize()) + ") times the micro-batches per step (" +
                      std::to_string(o.gradAccumulation) + ")");
  }
  if (o.checkpointEvery < 0) throw ConfigError("--checkpoint_every: expected 0 or more steps");
  if (o.snapshotEvery < 0) throw ConfigError("--snapshot_every " + std::to_string(o.snapshotEvery) + ": expected 0 or more steps");
  if (!o.checkpointDir.empty()) {
    impl_->checkpointer = std::make_unique<Checkpointer>(
        runtime, CheckpointOptions{.dir = o.checkpointDir, .keep = o.keepCheckpoints, .async = o.asyncCheckpoint});
  }
  const bool tty = ::isatty(STDOUT_FILENO) == 1 && std::getenv("TERM") != nullptr &&
                   std::string(std::getenv("TERM")) != "dumb";
  impl_->bar = o.progress == ProgressStyle::kBar || (o.progress == ProgressStyle::kAuto && tty);
  impl_->lines = o.progress == ProgressStyle::kLines || (o.progress == ProgressStyle::kAuto && !tty);
}

Trainer::~Trainer() = default;

Trainer::LossFn Trainer::crossEntropy() {
  return [](const at::Tensor& output, const Batch& batch) {
    if (output.dim() > 2) {
      return torch::nn::functional::cross_entropy(output.reshape({-1, output.size(-1)}), batch.target.reshape({-1}));
    }
    return torch::nn::functional::cross_entropy(output, batch.target);
  };
}

Trainer::LossFn Trainer::nllLoss() {
  return [](const at::Tensor& output, const Batch& batch) {
    if (output.dim() > 2) {
      return torch::nn::functional::nll_loss(output.reshape({-1, output.size(-1)}), batch.target.reshape({-1}));
    }
    return torch::nn::functional::nll_loss(output, batch.target);
  };
}

EvalResult Trainer::evaluate(const Dataset& data) {
  auto& d = *impl_;
  const auto& o = d.options;
  torch::NoGradGuard noGrad;
  d.model->eval();
  const std::int64_t batch = o.evalBatch > 0 ? o.evalBatch : 4 * o.globalBatch;
  DistributedSampler sampler(data.size(), d.runtime.rank(), d.runtime.worldSize(),
                             {.globalBatch = std::max<std::int64_t>(batch, d.runtime.worldSize()), .shuffle = false});
  DataLoader loader(data, sampler, {0, 0}, o.prefetch);
  double lossSum = 0, correct = 0, samples = 0;
  for (std::int64_t s = 0; s < sampler.stepsPerEpoch(); ++s) {
    const auto item = loader.next();
    // A last global batch smaller than the world is left out on every rank alike: under
    // sharding, a rank without data would miss its peers' collectives in the forward pass.
    if (item.globalBatch < d.runtime.worldSize()) continue;
    const auto b = d.onDevice(item.batch);
    const auto n = static_cast<double>(b.input.size(0));
    const at::Tensor out = (forward ? forward(d.model, b) : d.model->forward(b.input)).to(at::kFloat);
    lossSum += d.loss(out, b).item<double>() * n;
    markProgress(-1, "eval batch");  // a long evaluation is progress, not a hang
    if (o.accuracy) correct += out.argmax(-1).eq(b.target).sum().item<double>() / (b.target.numel() / n);
    samples += n;
  }
  const auto sums = [&] {
    CommTag tag("eval", "metrics");
    return d.reduce({lossSum, correct, samples});
  }();
  d.model->train();
  return {sums[2] > 0 ? sums[0] / sums[2] : 0.0, sums[2] > 0 ? sums[1] / sums[2] : 0.0,
          static_cast<std::int64_t>(sums[2])};
}

FitResult Trainer::fit(const Dataset& train, const Dataset* eval) {
  auto& d = *impl_;
  d.start = Clock::now();
  d.evaluated = {};
  std::optional<ReformInfo> reformed;
  int reforms = 0;
  for (;;) {
    try {
      return fitRound(train, eval, reformed ? &*reformed : nullptr, reforms);
    } catch (const std::exception& e) {
      // A failure elsewhere: the agent aborted this process's communicators (or a peer's death
      // was seen first and its notice follows). Anything else is this process's own.
      if (!reformPending(d.runtime)) throw;
      log::warn("rank {}: the step in progress is dropped, the world re-forms in process ({})", d.runtime.rank(),
                e.what());
      d.dropInterruptedState();
      reformed = reform(d.runtime, d.model);
      ++reforms;
    }
  }
}

FitResult Trainer::fitRound(const Dataset& train, const Dataset* eval, const ReformInfo* reformed, int reforms) {
  auto& d = *impl_;
  const auto& o = d.options;
  const int rank = d.runtime.rank();
  const int world = d.runtime.worldSize();
  DistributedSampler sampler(train.size(), rank, world,
                             {.globalBatch = o.globalBatch, .shuffle = o.shuffle, .seed = o.seed, .lastBatch = o.lastBatch});
  const std::int64_t stepsPerEpoch = sampler.stepsPerEpoch();
  const std::int64_t totalSteps = o.maxSteps > 0 ? std::min(o.maxSteps, stepsPerEpoch * o.epochs)
                                                 : stepsPerEpoch * o.epochs;
  // Runs cut short by --max_steps count steps, not epochs, in what they print.
  const bool bySteps = totalSteps < stepsPerEpoch * o.epochs && totalSteps < stepsPerEpoch;

  FitResult result;
  result.reforms = reforms;
  std::int64_t step = 0;
  SamplerPosition position;
  // Each rank its own stream (dropout differs per rank as it differs per sample in one process).
  const auto reseed = [&](std::int64_t atStep) {
    torch::manual_seed(o.seed * 1000003ULL + 1 + static_cast<std::uint64_t>(rank) +
                       static_cast<std::uint64_t>(atStep) * 7919ULL);
  };
  reseed(0);
  // Resume: the newest in-memory snapshot every rank holds, else the newest disk checkpoint.
  const auto restoreStart = Clock::now();
  // A new process agrees on snapshots as it builds its Snapshotter; a survivor of a re-formation,
  // whose state may lie in the snapshot the restore picks, agrees again with the same one.
  if (o.snapshotEvery > 0 && !d.snapshots) {
    d.snapshots = std::make_unique<Snapshotter>(d.runtime);
  } else if (reformed != nullptr && d.snapshots) {
    d.snapshots->rejoin();
  }
  std::optional<TrainingProgress> resumed;
  if (d.snapshots) {
    resumed = d.snapshots->restore(d.model, &d.optimizer);
    if (resumed) result.resumedSource = d.snapshots->restoredFrom();
  }
  if (resumed && d.checkpointer) {
    // Snapshots taken less often than checkpoints: a newer checkpoint on disk wins.
    std::int64_t onDisk = -1;
    if (d.leader()) {
      if (const auto newest = newestCheckpoint(o.checkpointDir)) {
        onDisk = std::stoll(std::filesystem::path(*newest).filename().string().substr(5));
      }
    }
    auto pick = at::full({1}, onDisk, at::kLong);
    const CommTag tag("trainer", "resume");
    d.runtime.cpuComm().broadcast(pick, 0).wait();
    if (pick.item<std::int64_t>() > resumed->step) resumed.reset();
  }
  if (!resumed && d.checkpointer) {
    resumed = d.checkpointer->loadLatest(d.model, &d.optimizer);
    if (resumed) result.resumedSource = "disk";
  }
  const double restoreMs = std::chrono::duration<double, std::milli>(Clock::now() - restoreStart).count();
  if (resumed) {
    step = resumed->step;
    position = resumed->position;
    result.resumedFrom = step;
    if (!resumed->rngRestored) reseed(step);
    const std::string reseeded = resumed->rngRestored ? "" : " (another world size: RNG reseeded)";
    if (result.resumedSource == "disk") {
      d.printLine("resumed from the checkpoint of step " + std::to_string(step) + " in " + o.checkpointDir + reseeded);
    } else {
      char took[32];
      std::snprintf(took, sizeof(took), "%.0f ms", restoreMs);
      std::string how;
      if (reformed != nullptr) {
        char text[160];
        std::snprintf(text, sizeof(text), " (re-formed in process in %.0f ms: round %d%s)", reformed->ms, reformed->round,
                      reformed->resharded ? ", shards laid out again for the new world" : "");
        how = text;
      }
      d.printLine("resumed from the in-memory snapshot of step " + std::to_string(step) +
                  (result.resumedSource == "memory" ? std::string() : " (the lost node's peer copy)") + " in " + took +
                  reseeded + how);
    }
  }
  if (d.leader() && !o.metricsFile.empty() && !d.metrics.is_open()) {
    d.metrics.open(o.metricsFile, result.resumedFrom ? std::ios::app : std::ios::trunc);
    if (!d.metrics) throw ConfigError("--metrics_file '" + o.metricsFile + "': cannot write it");
  }
  if (reformed != nullptr) {
    if (!resumed) {
      // The survivors' state is the interrupted step's: without a snapshot every rank holds, only
      // new processes (from disk, or from the start) agree on where to go on.
      throw ReformError("re-formed in process, but no snapshot or checkpoint to resume from: every process starts again");
    }
    reformDone(d.runtime);
  }
  if (resumed) {
    // process_age_s: how long after this process started the state was back (a restart's
    // cost is the launcher's part before that, this program's start-up, and the restore).
    // path: how rank 0 got here, a new process ("process") or one that re-formed ("in_process").
    json line{{"type", "resume"}, {"step", step}, {"source", result.resumedSource}, {"restore_ms", restoreMs},
              {"process_age_s", processAgeSeconds()}, {"unix_time", unixTime()},
              {"path", reformed != nullptr ? "in_process" : "process"}};
    if (reformed != nullptr) {
      line["reform_ms"] = reformed->ms;
      line["notice_to_reform_ms"] = reformed->noticeMs;
      line["round"] = reformed->round;
      if (reformed->resharded) line["resharded_from_world"] = reformed->previousWorldSize;
    }
    d.writeMetrics(line);
  }
  // From here on a failure elsewhere is survived in process (the agent is told), where a
  // re-formation can bring this state back: a snapshot or a checkpoint to restore, a model over
  // the runtime's own communicators.
  std::optional<ReformScope> survivable;
  if ((d.snapshots && d.snapshots->enabled()) || d.checkpointer) {
    survivable.emplace(d.runtime, d.model);
  }

  // A step resumed from a snapshot may have no disk checkpoint yet: only a disk resume counts.
  std::optional<std::int64_t> lastSaved =
      result.resumedSource == "disk" ? result.resumedFrom : std::optional<std::int64_t>();
  const auto checkpoint = [&](const SamplerPosition& next) {
    if (!d.checkpointer || lastSaved == step) return;
    // Written from the snapshot's memory when the state lies there: no copy on this thread.
    d.checkpointer->save(d.model, &d.optimizer,
                         {.step = step, .position = next, .seed = o.seed,
                          .extraJson = json{{"epochs", o.epochs}, {"global_batch", o.globalBatch}}.dump()},
                         /*frozen=*/d.snapshots && d.snapshots->frozen(d.model, d.optimizer));
    lastSaved = step;
  };
  const auto evaluateEpoch = [&](int epoch) {
    if (eval == nullptr) return;
    const auto t0 = Clock::now();
    result.eval = evaluate(*eval);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    char text[256];
    if (o.accuracy) {
      std::snprintf(text, sizeof(text), "eval epoch %d step %lld: loss %.4f accuracy %.4f (%lld samples, %.1f s)",
                    epoch + 1, static_cast<long long>(step), result.eval.loss, result.eval.accuracy,
                    static_cast<long long>(result.eval.samples), seconds);
    } else {
      std::snprintf(text, sizeof(text), "eval epoch %d step %lld: loss %.4f (%lld samples, %.1f s)", epoch + 1,
                    static_cast<long long>(step), result.eval.loss, static_cast<long long>(result.eval.samples), seconds);
    }
    d.printLine(text);
    json line{{"type", "eval"}, {"epoch", epoch + 1}, {"step", step}, {"loss", result.eval.loss},
              {"samples", result.eval.samples},
              {"elapsed_s", std::chrono::duration<double>(Clock::now() - d.start).count()}};
    if (o.accuracy) line["accuracy"] = result.eval.accuracy;
    d.writeMetrics(line);
    d.evaluated = {.epoch = epoch, .step = step, .result = result.eval, .wroteLines = d.leader()};
  };

  // Interval accumulators (this rank), reduced at every log line.
  double lossSum = 0, samples = 0, tokens = 0;
  std::int64_t intervalSteps = 0;
  auto intervalStart = Clock::now();
  double trainSeconds = 0, totalSamples = 0, totalTokens = 0;
  // The same past the first kWarmupSteps steps of this run, which touch memory for the first time.
  double steadySeconds = 0, steadySamples = 0;
  std::int64_t stepsThisRun = 0;
  double lastLr = 0;
  std::int64_t lastEvalStep = -1;
  d.model->train();
  const CheckpointSignal checkpointSignal(d.checkpointer ? o.checkpointSignal : 0);
  // An epoch's evaluation. At the step a resume came back to (nothing trained since), it may
  // have run before the failure: where a survivor of the re-formation wrote its lines (it was
  // rank 0 then), every rank takes that survivor's result; otherwise (that process is gone, or
  // every process restarted) it runs again, with the same result.
  const auto evaluateOnce = [&](int epoch) {
    lastEvalStep = step;
    if (eval == nullptr) return;
    if (result.resumedFrom != step) return evaluateEpoch(epoch);
    const auto& e = d.evaluated;
    const bool wrote = e.wroteLines && e.epoch == epoch && e.step == step;
    const auto mine = [wrote](double v) { return wrote ? v : -1e300; };
    const auto known = d.reduce({mine(1), mine(e.result.loss), mine(e.result.accuracy),
                                 mine(static_cast<double>(e.result.samples))}, ReduceOp::kMax);
    if (known[0] <= 0) return evaluateEpoch(epoch);
    result.eval = {known[1], known[2], static_cast<std::int64_t>(known[3])};
    d.evaluated = {.epoch = epoch, .step = step, .result = result.eval, .wroteLines = wrote};
  };
  // Resumed at an epoch's end (the snapshot or checkpoint of its last step): that epoch's
  // evaluation may not have run, or not to its end (the failure came first, or during it). It
  // runs now, before the next epoch's first step, unless a survivor wrote it.
  if (result.resumedFrom && o.evaluateEveryEpoch && position.step == 0 && position.epoch > 0 &&
      position.epoch < o.epochs && (o.maxSteps == 0 || step < o.maxSteps)) {
    evaluateOnce(position.epoch - 1);
  }
  {
    DataLoader loader(train, sampler, position, o.prefetch);
    int epoch = position.epoch;
    while (epoch < o.epochs && (o.maxSteps == 0 || step < o.maxSteps)) {
      const auto item = loader.next();
      if (item.position.epoch != epoch) {  // the previous epoch is complete
        if (o.evaluateEveryEpoch && lastEvalStep != step) evaluateOnce(epoch);
        epoch = item.position.epoch;
        if (epoch >= o.epochs) break;
      }
      // A last global batch too small to give every rank (and micro-batch) an example is left
      // out, on every rank alike: a rank without data would miss the collectives.
      if (item.globalBatch < static_cast<std::int64_t>(world) * o.gradAccumulation) {
        position = sampler.next(item.position);
        continue;
      }
      const auto stepStart = Clock::now();
      if (o.lrSchedule) {
        lastLr = o.lrSchedule(step);
        for (auto& group : d.optimizer.param_groups()) group.options().set_lr(lastLr);
      } else if (!d.optimizer.param_groups().empty()) {
        lastLr = d.optimizer.param_groups().front().options().get_lr();
      }
      d.optimizer.zero_grad();
      const auto b = d.onDevice(item.batch);
      // Every rank has at least gradAccumulation examples here (the skip above). Exactly
      // gradAccumulation micro-batches on every rank, sizes differing by at most one: chunk()
      // would make fewer where the local batch does not divide, and the ranks' collectives
      // would no longer pair.
      const std::int64_t local = b.input.size(0);
      double stepLoss = 0, stepSamples = 0;
      const auto inputs = b.input.tensor_split(o.gradAccumulation);
      const auto targets = b.target.tensor_split(o.gradAccumulation);
      for (std::size_t m = 0; m < inputs.size(); ++m) {
        const Batch part{inputs[m], targets[m], b.tokens * inputs[m].size(0) / local};
        const auto n = static_cast<double>(part.input.size(0));
        // FSDP averages gradients over ranks; scaling each micro-batch's mean by its share of
        // the global batch makes the sum of everything the global batch's mean.
        const double scale = n * world / static_cast<double>(item.globalBatch);
        const auto run = [&] {
          const at::Tensor out = (forward ? forward(d.model, part) : d.model->forward(part.input)).to(at::kFloat);
          const at::Tensor l = d.loss(out, part);
          (l * scale).backward();
          const double value = l.item<double>();
          lossSum += value * n;
          stepLoss += value * n;
        };
        if (m + 1 < inputs.size()) {
          auto guard = d.model->noSync();
          run();
        } else {
          run();
        }
        samples += n;
        stepSamples += n;
        tokens += static_cast<double>(part.tokens);
      }
      if (o.clipGradNorm > 0) d.model->clipGradNorm(o.clipGradNorm);
      // With snapshots, the step writes into the next snapshot's memory (no copy to take one).
      if (d.snapshots) {
        d.snapshots->step(d.model, d.optimizer);
      } else {
        d.optimizer.step();
      }
      ++step;
      reportStep(static_cast<std::int64_t>(stepSamples), b.tokens, stepSamples > 0 ? stepLoss / stepSamples : 0.0);
      markProgress(step, "trainer step");
      if (d.leader()) d.reportStragglers();
      if (d.snapshots && step % o.snapshotEvery == 0) {
        d.snapshots->save(d.model, &d.optimizer,
                          {.step = step, .position = sampler.next(item.position), .seed = o.seed,
                           .extraJson = json{{"epochs", o.epochs}, {"global_batch", o.globalBatch}}.dump()});
      }
      ++intervalSteps;
      const double stepSeconds = std::chrono::duration<double>(Clock::now() - stepStart).count();
      trainSeconds += stepSeconds;
      totalSamples += static_cast<double>(item.globalBatch);
      if (++stepsThisRun > kWarmupSteps) {
        steadySeconds += stepSeconds;
        steadySamples += static_cast<double>(item.globalBatch);
      }
      totalTokens += static_cast<double>(b.tokens) * world;
      if (afterStep) afterStep(step);

      const std::int64_t inEpoch = item.position.step + 1;
      const std::int64_t shownStep = bySteps ? step : inEpoch;
      const std::int64_t shownTotal = bySteps ? totalSteps : stepsPerEpoch;
      char where[64];
      if (bySteps) {
        std::snprintf(where, sizeof(where), "train");
      } else {
        std::snprintf(where, sizeof(where), "train epoch %d/%d", epoch + 1, o.epochs);
      }
      if (d.bar && d.leader()) {
        const double perSecond = totalSamples / std::max(trainSeconds, 1e-9);
        const double remaining = static_cast<double>(totalSteps - step) * trainSeconds /
                                 std::max<double>(1, static_cast<double>(step - result.resumedFrom.value_or(0)));
        const int width = 24;
        const int filled = static_cast<int>(width * shownStep / std::max<std::int64_t>(1, shownTotal));
        char text[320];
        std::snprintf(text, sizeof(text), "\r%s [%s%s] %lld/%lld %3d%% %s samples/s loss %.4f ETA %s\x1b[K",
                      where, std::string(static_cast<std::size_t>(filled), '#').c_str(),
                      std::string(static_cast<std::size_t>(width - filled), '.').c_str(),
                      static_cast<long long>(shownStep), static_cast<long long>(shownTotal),
                      static_cast<int>(100 * shownStep / std::max<std::int64_t>(1, shownTotal)),
                      rate(perSecond).c_str(), samples > 0 ? lossSum / samples : 0.0, clock(remaining).c_str());
        [[maybe_unused]] const auto w = ::write(STDOUT_FILENO, text, std::strlen(text));
        d.barOpen = true;
      }
      const bool last = (o.maxSteps > 0 && step >= o.maxSteps) || (inEpoch == stepsPerEpoch && epoch + 1 == o.epochs);
      if (o.logEvery > 0 && (step % o.logEvery == 0 || last)) {
        const double seconds = std::chrono::duration<double>(Clock::now() - intervalStart).count();
        const auto sums = d.reduce({lossSum, samples, tokens});
        const double peak = d.reduce({peakRssMb()}, ReduceOp::kMax)[0];
        result.trainLoss = sums[1] > 0 ? sums[0] / sums[1] : 0.0;
        const double samplesPerSecond = sums[1] / std::max(seconds, 1e-9);
        const double tokensPerSecond = sums[2] / std::max(seconds, 1e-9);
        const double stepMs = 1000.0 * seconds / static_cast<double>(std::max<std::int64_t>(intervalSteps, 1));
        json line{{"type", "train"}, {"epoch", epoch + 1}, {"step", step}, {"loss", result.trainLoss},
                  {"lr", lastLr}, {"samples_per_s", samplesPerSecond}, {"step_time_ms", stepMs},
                  {"peak_rss_mb", peak}, {"unix_time", unixTime()},
                  {"collectives", detail::FlightRecorder::process().issued()},
                  {"elapsed_s", std::chrono::duration<double>(Clock::now() - d.start).count()}};
        if (sums[2] > 0) line["tokens_per_s"] = tokensPerSecond;
        d.writeMetrics(line);
        if (d.lines) {
          const double remaining = static_cast<double>(totalSteps - step) * stepMs / 1000.0;
          char text[256];
          std::snprintf(text, sizeof(text),
                        "%s step %lld/%lld: loss %.4f, %s samples/s%s, %.1f ms/step, peak %.0f MB, ETA %s", where,
                        static_cast<long long>(shownStep), static_cast<long long>(shownTotal),
                        result.trainLoss, rate(samplesPerSecond).c_str(),
                        sums[2] > 0 ? (", " + rate(tokensPerSecond) + " tokens/s").c_str() : "", stepMs, peak,
                        clock(remaining).c_str());
          d.printLine(text);
        }
        result.peakRssMb = std::max(result.peakRssMb, peak);
        lossSum = samples = tokens = 0;
        intervalSteps = 0;
        intervalStart = Clock::now();
      }
      if (eval != nullptr && o.evalEvery > 0 && step % o.evalEvery == 0) {
        evaluateEpoch(epoch);
        lastEvalStep = step;
      }
      bool save = d.checkpointer && o.checkpointEvery > 0 && step % o.checkpointEvery == 0;
      if (checkpointSignal.installed()) {
        // The signal reaches the ranks at different steps: they agree on it after each step.
        const bool requested = detail::takeCheckpointRequest();
        if (d.reduce({requested ? 1.0 : 0.0}, ReduceOp::kMax)[0] > 0) {
          d.printLine("checkpoint requested by signal " + std::to_string(o.checkpointSignal) + ": saving step " +
                      std::to_string(step));
          save = true;
        }
      }
      if (save) checkpoint(sampler.next(item.position));
      position = sampler.next(item.position);
    }
    if (lastEvalStep != step) evaluateOnce(std::min(epoch, o.epochs - 1));
  }
  if (d.snapshots) d.snapshots->wait();
  d.reportStragglers(/*summary=*/true);
  checkpoint(position);
  if (d.checkpointer) d.checkpointer->wait();
  if (d.barOpen && d.leader()) emitLine("");
  d.barOpen = false;
  result.steps = step;
  result.samplesPerSecond = totalSamples / std::max(trainSeconds, 1e-9);
  if (steadySamples > 0) result.steadySamplesPerSecond = steadySamples / std::max(steadySeconds, 1e-9);
  result.tokensPerSecond = totalTokens / std::max(trainSeconds, 1e-9);
  result.peakRssMb = std::max(result.peakRssMb, d.reduce({peakRssMb()}, ReduceOp::kMax)[0]);
  return result;
}

}  // namespace fsdp::worker
