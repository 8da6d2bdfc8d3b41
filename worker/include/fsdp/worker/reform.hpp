#pragma once
// Survivors never exit. Under fsdprun --restart_mode auto (the default), when a worker of the
// job fails (on this node or another, or is named stuck by the hang watchdog), the agents kill
// only that worker: the others' communicators are aborted, every blocked collective throws,
// and each survivor re-forms in process: it joins the next round (the failed worker's new
// process fills its place; where a node was lost or added, the world changes size and ranks
// may move), rebuilds its communicators and FSDP's state (its shards laid out again for a new
// world size), and restores the newest snapshot every rank holds (its own piece from its
// agent's memory; across world sizes, the pieces its new shards need). What a new process pays (start-up, LibTorch, data, the model) only the replaced
// worker pays. fsdp::Trainer does all of it; a hand-written loop does this:
//
//   auto rt = fsdp::init();
//   fsdp::FullyShardedDataParallel model(net, rt->comm(), options);
//   torch::optim::Adam optimizer(model->parameters());
//   auto snapshots = std::make_unique<fsdp::Snapshotter>(*rt);
//   auto resumed = snapshots->restore(model, &optimizer);        // a new process starts here
//   fsdp::ReformScope scope(*rt, model);                          // survivable from here on
//   for (;;) {
//     try {
//       ... the steps, snapshots->step(...) and snapshots->save(...) after each ...
//       break;
//     } catch (const std::exception& e) {
//       if (!fsdp::reformPending(*rt)) throw;                     // this process's own failure
//       snapshots->wait();                                        // what was in flight
//       fsdp::reform(*rt, model);                                 // the new round
//       snapshots->rejoin();                                      // as a new one is constructed
//       resumed = snapshots->restore(model, &optimizer);         // else: throw (process restart)
//       fsdp::reformDone(*rt);
//     }
//   }
//
// The contract: between building the FSDP model and the restore, a survivor issues exactly the
// collectives a new process issues there (reform() replays FSDP's constructor's; the program
// repeats what it does after it: the Snapshotter's agreement (rejoin()), the restore). Its own
// state is not copied when it lies in the snapshot restored (its memory is that snapshot's). A
// new process's sharded weights before the restore are unset (in a round with survivors its
// constructor neither broadcasts rank 0's nor lays out its own: the restore writes them all):
// do not read them. Training resumes from the restored step on every rank: the survivor's loop
// must take the step, the data position and the RNG from what restore() returned, as a new
// process does; and its rank and world from the runtime again (rt->rank(), rt->worldSize(): a
// data sampler built on them is built again). A backward under way when the notice comes
// throws CommAborted at its next gradient (FSDP's hook), as its collectives would later. A wait
// of the loop's own on rt->store() (get, wait, addAndWait, waitForChange) throws CommAborted
// within 0.2 s of the agent's notice, as a blocked collective does, until reform() begins;
// rt->store() is the same object before and after (a reference to it stays good, also when the
// rendezvous moved to another node).
//
// What still restarts processes (the agent says why in one line): the failed process itself; a
// worker outside a ReformScope (a PyTorch script, a program that does not use this) or already
// re-forming (a second failure during a re-formation); a new round in which this worker's
// local rank changed; HYBRID_SHARD's extra groups; a second FSDP model over the runtime's
// communicator; a re-formation
// that fails (reform() or the restore throws: the process ends, the agent starts a new one).

#include <chrono>
#include <string>

#include "fsdp/common/error.hpp"
#include "fsdp/worker/fsdp.hpp"
#include "fsdp/worker/runtime.hpp"

namespace fsdp::worker {

// This process cannot re-form in process (its local rank moved, the model uses groups the
// runtime does not own, no control channel): let it end; the agent starts a new one.
class ReformError : public Error {
 public:
  using Error::Error;
};

// While one lives, this process tells its agent that a failure elsewhere is survived here (a
// loop that catches it and calls reform() runs). Nothing happens outside fsdprun's auto mode.
// Given the model, only where canReform(runtime, model) holds; where it does not, it says why
// (once a process: a warning on rank 0) and a failure elsewhere restarts this process.
class ReformScope {
 public:
  explicit ReformScope(Runtime& runtime);
  ReformScope(Runtime& runtime, FullyShardedDataParallel& model);
  ~ReformScope();
  ReformScope(const ReformScope&) = delete;
  ReformScope& operator=(const ReformScope&) = delete;

 private:
  bool active_ = false;
};

// Whether `model` can be carried through a re-formation here: under an agent's control channel,
// its collectives on the runtime's own communicator (not HYBRID_SHARD's groups, which the
// program built), and the only FSDP model over it in this process (reform() rebuilds one model's
// state: a GAN's two, a teacher beside its student cannot re-form). A loop enters its
// ReformScope only where this holds (ReformScope(runtime, model) checks it).
bool canReform(Runtime& runtime, FullyShardedDataParallel& model);

// After a step threw: whether the world is re-forming (the agent's notice came). When the error
// came from a collective (a peer died, and this rank saw it first), waits up to `bound` for the
// notice; an error of this process's own returns false at once.
bool reformPending(Runtime& runtime, std::chrono::milliseconds bound = std::chrono::seconds(30));

struct ReformInfo {
  int round = 0;         // the new round
  int restartCount = 0;  // TORCHELASTIC_RESTART_COUNT now
  double ms = 0;         // from the call to the communicators rebuilt and FSDP's collectives done
  std::string why;       // the agent's reason for ending the round
  // Where this process was before (Runtime::rank() and worldSize() say where it is now), and
  // whether FSDP's shards were laid out again because the world changed size.
  int previousRank = 0;
  int previousWorldSize = 0;
  bool resharded = false;
  // From the agent's notice reaching this process to this call: the work it finished before it
  // saw the round end (a collective on a dead peer wakes at once; a computation runs to its next
  // collective).
  double noticeMs = 0;
};

// The new round: waits for it (the agent sends it once every node has joined), takes its
// environment, rebuilds the runtime's communicators and the store connection where it moved,
// drops what the interrupted step left in `model`, issues FSDP's collective of construction
// (the model check) with the round's new processes, as a survivor: their constructors then do
// not broadcast rank 0's weights (syncModuleStates), the restore writes every parameter and
// buffer on every rank. When the world changed size, it lays the shards out for
// it: their values and the optimizer's state for them are then the restore's to write (until
// it, the optimizer holds state of the old size: restore before stepping). Throws ReformError when this process cannot go
// on (see above), other errors when the new round fails; either way the process should end.
// Called with no re-formation under way (not after reformPending() returned true), it throws
// ReformError at once and changes nothing.
ReformInfo reform(Runtime& runtime, FullyShardedDataParallel& model);

// Training resumed after reform() and the restore: a failure elsewhere is survived again.
// Outside a re-formation it does nothing.
void reformDone(Runtime& runtime);

}  // namespace fsdp::worker

namespace fsdp {
using worker::canReform;
using worker::reform;
using worker::reformDone;
using worker::ReformError;
using worker::ReformInfo;
using worker::reformPending;
using worker::ReformScope;
}  // namespace fsdp
