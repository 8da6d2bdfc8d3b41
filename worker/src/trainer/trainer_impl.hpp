#pragma once
// The Trainer's state (trainer.cpp): what it was built with, its output, and what a survivor of
// an in-process re-formation keeps across rounds. Private to libfsdp.

#include <chrono>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/recorded_communicator.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/worker/checkpoint.hpp"
#include "fsdp/worker/runtime.hpp"
#include "fsdp/worker/snapshot.hpp"
#include "fsdp/worker/trainer.hpp"
#include "stats/straggler.hpp"
#include "trainer/trainer_output.hpp"

namespace fsdp::worker {

struct Trainer::Impl {
  Runtime& runtime;
  FullyShardedDataParallel& model;
  torch::optim::Optimizer& optimizer;
  LossFn loss;
  TrainerOptions options;
  std::unique_ptr<Checkpointer> checkpointer;
  std::unique_ptr<Snapshotter> snapshots;
  std::ofstream metrics;
  bool bar = false;
  bool lines = false;
  bool barOpen = false;  // a bar line is on screen without its newline
  std::chrono::steady_clock::time_point start;
  // This process's last evaluation of an epoch, and whether it wrote the lines (it was rank 0):
  // a survivor of a re-formation keeps it across rounds (fitRound's evaluateOnce).
  struct Evaluated {
    int epoch = -1;
    std::int64_t step = -1;
    EvalResult result;
    bool wroteLines = false;
  } evaluated;

  Impl(Runtime& rt, FullyShardedDataParallel& m, torch::optim::Optimizer& o, LossFn l, TrainerOptions opt)
      : runtime(rt), model(m), optimizer(o), loss(std::move(l)), options(std::move(opt)) {}

  bool leader() const { return runtime.rank() == 0; }

  // Before an in-process re-formation: what the interrupted round left in flight finishes or
  // fails (a snapshot being handed to the agent, a checkpoint being written).
  void dropInterruptedState() {
    barOpen = false;
    if (snapshots) {
      try {
        snapshots->wait();
      } catch (const std::exception& e) {
        log::warn("rank {}: the snapshot in flight when the world re-formed failed: {}", runtime.rank(), e.what());
      }
    }
    if (checkpointer) {
      try {
        checkpointer->wait();
      } catch (const std::exception& e) {
        log::warn("rank {}: the checkpoint being written when the world re-formed failed: {}", runtime.rank(), e.what());
      }
    }
  }

  void printLine(const std::string& text) {
    if (!leader() || options.progress == ProgressStyle::kNone) return;
    if (barOpen) {
      detail::emitLine("");
      barOpen = false;
    }
    detail::emitLine(text);
  }

  void writeMetrics(const nlohmann::json& line) {
    if (metrics.is_open()) {
      metrics << line.dump() << '\n';
      metrics.flush();
    }
  }

  // Rank 0: the straggler monitor's new findings into the metrics file (its thread logged them),
  // and at the end the run's summary line.
  void reportStragglers(bool summary = false) {
    const auto monitor = detail::StragglerMonitor::active();
    if (!monitor || !leader()) return;
    for (const auto& e : monitor->takeEvents()) {
      writeMetrics({{"type", e.recovered ? "straggler_recovered" : "straggler"}, {"rank", e.rank}, {"node", e.node},
                    {"factor", e.factor}, {"compute_ms", e.computeMs}, {"median_compute_ms", e.medianComputeMs},
                    {"wait_ms", e.waitMs}, {"data_ms", e.dataMs}, {"first_step", e.firstStep},
                    {"last_step", e.lastStep}, {"unix_time", detail::unixTime()}});
    }
    if (summary && monitor->reports() > 0) {
      const std::string line = monitor->summary();
      printLine(line);
      writeMetrics({{"type", "stragglers"}, {"reports", monitor->reports()}, {"summary", line}});
    }
  }

  // The batch where the model computes (the communicator's device: a CUDA device under NCCL).
  Batch onDevice(const Batch& batch) const {
    const auto device = runtime.device();
    if (device.is_cpu()) return batch;
    return {batch.input.to(device, /*non_blocking=*/true), batch.target.to(device, /*non_blocking=*/true),
            batch.tokens};
  }

  // Sums (or maxima) over every rank.
  std::vector<double> reduce(std::vector<double> values, ReduceOp op = ReduceOp::kSum) {
    auto t = at::tensor(values, at::kDouble);
    const CommTag tag("trainer", "metrics");
    runtime.cpuComm().allReduce(t, op).wait();
    const auto* p = t.data_ptr<double>();
    return std::vector<double>(p, p + values.size());
  }
};

}  // namespace fsdp::worker
