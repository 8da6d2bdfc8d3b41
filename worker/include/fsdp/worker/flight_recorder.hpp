#pragma once
// What the hang watchdog of fsdprun sees of a training program: every collective of every
// communicator fsdp::init() and makeHybridGroups() build is recorded (group, sequence number,
// operation, size, who asked, when issued/started/completed) in a ring the agent reads, and the
// program marks its progress. fsdp::Trainer and fsdp::Snapshotter mark every step themselves; a
// hand-written loop calls markProgress() once per step:
//
//   for (int step = 0; step < steps; ++step) {
//     ...forward, backward, optimizer step...
//     fsdp::markProgress(step);
//   }
//
// and may say who issues a collective, for the hang report:
//
//   { fsdp::CommTag tag("eval", "accuracy"); rt->cpuComm().allReduce(correct).wait(); }
//
// Both are a few atomic stores into shared memory, safe from any thread, and do nothing when
// the recorder is off (FSDPRUN_FLIGHT_RECORDER=0).

#include <cstdint>
#include <limits>
#include <string_view>

namespace fsdp::worker {

// Records that the program completed `step` (any increasing number). `what` says who marks
// ("step" by default; the Trainer says "trainer step"), up to 23 characters. A negative step
// marks activity (an evaluation batch) and keeps the step last marked.
void markProgress(std::int64_t step, std::string_view what = "step");

// The figures of the step about to be marked, for the agent's /metrics: this rank's samples and
// tokens in it and its loss (NaN: none). fsdp::Trainer reports them itself; a hand-written loop
// calls it before markProgress().
void reportStep(std::int64_t samples, std::int64_t tokens = 0,
                double loss = std::numeric_limits<double>::quiet_NaN());

// While alive, the training thread waits for input data: the step split counts that time as
// data, not compute. fsdp::DataLoader::next() does this itself.
class DataWait {
 public:
  DataWait();
  ~DataWait();
  DataWait(const DataWait&) = delete;
  DataWait& operator=(const DataWait&) = delete;

 private:
  std::int64_t startNs_;
};

// While alive, this rank is busy in its own work, not stalled: for long work that issues no
// collective, marks nothing and waits for no other rank (writing or reading this rank's own
// checkpoint files). `what` names it in the hang report, up to 16 characters ("checkpoint
// write"). Nests (the outermost names it); any thread.
//
// fsdprun's watchdog does not declare the job hung while some rank of the job is inside one,
// on any node, for up to 10 times the hang timeout: its waiting peers are not a hang. Past that
// the report names the rank and how long it has been inside. Never hold one across a wait for
// other ranks (a collective, a store wait): a rank stalled elsewhere would then hide behind it.
class LongOperation {
 public:
  explicit LongOperation(std::string_view what = {});
  ~LongOperation();
  LongOperation(const LongOperation&) = delete;
  LongOperation& operator=(const LongOperation&) = delete;
};

// While alive, the collectives this thread issues carry "<phase> <what>" (e.g. "backward
// blocks.3"), up to 47 characters, as who asked for them. Tags nest: the inner one wins and the
// outer one comes back when it goes.
class CommTag {
 public:
  explicit CommTag(std::string_view phase, std::string_view what = {});
  ~CommTag();
  CommTag(const CommTag&) = delete;
  CommTag& operator=(const CommTag&) = delete;

 private:
  char previous_[48];
};

}  // namespace fsdp::worker

namespace fsdp {
using worker::CommTag;
using worker::DataWait;
using worker::reportStep;
using worker::LongOperation;
using worker::markProgress;
}  // namespace fsdp
