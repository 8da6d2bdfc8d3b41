#pragma once
// The worker's end of its agent's control channel (fsdprun --restart_mode auto): how survivors
// of a failure learn that the world re-forms, and how the agent learns which workers can.
//
// FSDPRUN_CONTROL_FD names one end of a SOCK_SEQPACKET socket pair; one JSON object a packet.
//   worker -> agent  {"ready": true}   a loop that re-forms in process runs (ReformScope)
//                    {"ready": false}  it does not (left, or re-forming: a new failure now
//                                      costs this process)
//                    {"reformed": {"round": N}}  back in training after a re-formation
//                    {"device_memory": B}  whether it may hold GPU memory (false: LibTorch has
//                                      no CUDA device here; the agent then need not wait for
//                                      the kernel to free a dead one's memory before replacing it)
//   agent -> worker  {"abort": "why"}  the round ended: every communicator is aborted now
//                    {"reform": {"env": {KEY: VALUE}}}  the new round: what changed in the
//                                      environment (RANK, WORLD_SIZE, FSDPRUN_ROUND, ...)
// The agent's end closing (the agent died) wakes every wait here with an error.
//
// Thread-safety: every member may be called from any thread; the reader thread calls the abort
// hooks.

#include <chrono>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace fsdp::worker::detail {

class ReformControl {
 public:
  // The process's channel: opened on first use from FSDPRUN_CONTROL_FD (removed from the
  // environment); inactive when the variable is unset (no agent, or --restart_mode process).
  static ReformControl& process();

  bool active() const { return fd_ >= 0; }
  // Tells the agent whether a failure elsewhere may be survived in process. Counted: ready while
  // at least one holder says so.
  void setReady(bool ready);
  // What aborts this process's communicators when the agent's notice comes (the runtime's).
  // Returns an id for removeAbortHook.
  int addAbortHook(std::function<void(const std::string& why)> hook);
  void removeAbortHook(int id);

  // Whether the agent's abort notice came (since the last re-formation), waiting up to `bound`
  // for it. A collective that failed because a peer died may be woken before the notice.
  bool awaitAbort(std::chrono::milliseconds bound);
  // Why the round ended ("" before a notice).
  std::string abortReason() const;
  // When the notice came (steady clock); nullopt before one.
  std::optional<std::chrono::steady_clock::time_point> abortTime() const;
  // Throws CommAborted naming `what` when the agent's notice came and this process has not begun
  // to re-form: a wait of the program's (on the runtime's store: a hand-written loop's, rank 0's
  // for a checkpoint's files) ends there instead of holding the re-formation for its timeout.
  void throwIfAborted(const char* what) const;
  // The new round's environment changes, waiting up to `bound`; nullopt when the bound passed or
  // the channel closed (`why` says which).
  std::optional<std::map<std::string, std::string>> awaitReform(std::chrono::milliseconds bound, std::string& why);
  // Tells the agent whether this process may hold GPU memory (once, at fsdp::init()).
  void tellDeviceMemory(bool mayHold);
  // Re-forming: not ready (a second failure now costs this process) until reformed().
  void setReforming(bool reforming);
  // Back in training: clears the notice, tells the agent (ready again if a scope holds).
  void reformed(int round);

  // A collective failed in this process (the recorded communicator's note): a peer's death
  // seen before the agent's notice.
  void noteCollectiveFailure() { ++collectiveFailures_; }
  unsigned collectiveFailures() const { return collectiveFailures_; }

 private:
  ReformControl();
  void send(const std::string& text);
  void readLoop();

  int fd_ = -1;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  // Sends the state when it changed. Caller holds mutex_.
  void announceLocked();
  int readyCount_ = 0;
  bool reforming_ = false;
  bool announced_ = false;  // what the agent was told last
  bool aborted_ = false;
  std::string abortReason_;
  std::chrono::steady_clock::time_point abortedAt_{};
  std::optional<std::map<std::string, std::string>> reform_;
  bool closed_ = false;
  int nextHook_ = 1;
  std::map<int, std::function<void(const std::string&)>> hooks_;
  // Held while the hooks run: removeAbortHook() waits for a running one (its runtime may go next).
  std::mutex hooksRunning_;
  std::atomic<unsigned> collectiveFailures_{0};
  std::thread reader_;
};

}  // namespace fsdp::worker::detail
