#pragma once
// A communicator whose operations do nothing, and a timer of collectives on it: wrapped by the
// flight recorder, what is left is the recorder's own cost (hang's recorder_cost, telemetry's
// micro-benchmark).

#include <ATen/Functions.h>

#include <algorithm>
#include <chrono>

#include "fsdp/worker/communicator.hpp"
#include "fsdp/worker/flight_recorder.hpp"

namespace fsdp::bench {

class NullCommunicator final : public worker::Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  c10::DeviceType deviceType() const override { return c10::DeviceType::CPU; }
  const char* backendName() const override { return "null"; }
  worker::Work allReduce(at::Tensor, worker::ReduceOp) override { return done(); }
  worker::Work allGather(at::Tensor, at::Tensor) override { return done(); }
  worker::Work reduceScatter(at::Tensor, at::Tensor, worker::ReduceOp) override { return done(); }
  worker::Work broadcast(at::Tensor, int) override { return done(); }
  worker::Work barrier() override { return done(); }

 private:
  static worker::Work done() {
    return worker::completedWork([] {});
  }
};

// Nanoseconds per allReduce(...).wait() on `comm`, each under a CommTag, the best of 5 runs of `n`.
inline double nsPerCollective(worker::Communicator& comm, int n) {
  const at::Tensor t = at::zeros({1});
  double best = 1e18;
  for (int run = 0; run < 5; ++run) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) {
      worker::CommTag tag("backward", "blocks.3");
      comm.allReduce(t, worker::ReduceOp::kSum).wait();
    }
    best = std::min(
        best,
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() /
            n);
  }
  return best;
}

}  // namespace fsdp::bench
