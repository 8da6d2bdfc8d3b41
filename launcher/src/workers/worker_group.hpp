#pragma once
// The workers of one node for one round: spawned in their own process groups, their output
// routed (console, log files, "[rank<N>]:" prefixes), their stderr tail kept for the failure
// report, and their exits reaped. Private to the launcher; driven by the agent's poll loop.
//
// Thread-safety: none; the agent's thread owns it.

#include <poll.h>

#include <chrono>
#include <deque>
#include <map>
#include <nlohmann/json.hpp>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fsdp/common/deadline.hpp"
#include "fsdp/common/flight_ring.hpp"
#include "fsdp/common/lifeline.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/launcher/log_spec.hpp"
#include "guardian.hpp"
#include "py_stacks.hpp"

namespace fsdp::launcher::detail {

struct WorkerSpec {
  int localRank = 0;
  int rank = 0;
  std::vector<std::string> argv;
  std::vector<std::string> env;  // full environment, "KEY=VALUE"
  std::vector<int> cpus;         // --numa_binding's CPUs; empty: inherited
  std::vector<int> memNodes;     // --numa_binding's memory nodes; empty: the default policy
};

struct OutputOptions {
  StreamSpec redirects;
  StreamSpec tee;
  std::optional<std::set<int>> localRanksFilter;
};

struct WorkerExit {
  int localRank = 0;
  int rank = 0;
  pid_t pid = -1;
  int status = 0;  // wait status
  double secondsAfterStart = 0;
};

// A worker as the hang watchdog sees it: who, and its flight recorder ring (the agent's
// mapping, shared so that it outlives the group while a report is being made).
struct WatchedWorker {
  int localRank = 0;
  int rank = 0;
  pid_t pid = -1;
  std::shared_ptr<const flight::RingMemory> ring;  // nullptr: none could be made
  std::shared_ptr<const PyStackFile> pystacks;      // nullptr: none could be made
};

class WorkerGroup {
 public:
  // Starts one process per spec, each in its own process group that `guardian` watches. Each
  // local rank's files live in attemptDir/<local_rank>/ ({stdout,stderr}.log when redirected
  // or tee'd, error.json for TORCHELASTIC_ERROR_FILE, which the specs' environments must
  // already name). Throws ConfigError/Error from spawn.
  //
  // `standby`: the workers are spares for a later round. Each gets FSDPRUN_STANDBY_FD, a pipe on
  // which fsdp::init() waits (the program has loaded, read its data, whatever it does before
  // init()); activate() hands them their round. Their output stays in its pipes until then, or
  // until one exits while it waits (exitedSpares()).
  //
  // `control`: each worker gets FSDPRUN_CONTROL_FD, its control channel (--restart_mode auto;
  // worker/src/reform/control.hpp): a libfsdp program that is training says so on it, and may
  // then survive a failure elsewhere in process (reformable(), notifyAbort(), reform()).
  WorkerGroup(std::vector<WorkerSpec> specs, const OutputOptions& output, std::string attemptDir,
              Guardian& guardian, bool standby = false, bool control = false);
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // The output pipes still open and the lifelines' news, for poll().
  void addPollFds(std::vector<pollfd>& fds) const;
  // Moves whatever the readable pipes hold to its destinations.
  void pump(const std::vector<pollfd>& fds);
  // The workers that exited since the last call, each once: those that began to exit (told by
  // their lifeline, before the kernel has torn down their memory) and those reaped. Drains
  // their output first and kills what they left in their process groups. Logs workers stopped
  // (SIGSTOP) or continued.
  std::vector<WorkerExit> reap();
  // Sends `sig` to every running worker's process group; after a stop signal also SIGCONT, so
  // that a stopped worker can act on it.
  void signalAll(int sig, const std::set<int>& spare = {});
  // Workers not reaped yet, besides the local ranks `besides`. One that has begun to exit still
  // counts (its memory, a GPU's included, is not free before it is reaped), unless its program
  // said it holds no GPU memory (control channel): the kernel frees host memory by itself.
  std::size_t running(const std::set<int>& besides = {}) const;

  // In-process re-formation (worker_control.cpp). The local ranks running whose program says it
  // survives a failure elsewhere (a libfsdp loop in a ReformScope, not re-forming already).
  std::set<int> reformable() const;
  std::set<int> runningLocalRanks() const;
  // The local ranks told to re-form in process (notifyAbort()) that have not said they re-formed.
  std::set<int> reforming() const;
  // Tells these workers that the round ended: they abort their communicators and wait.
  void notifyAbort(const std::set<int>& localRanks, const std::string& why);
  // The new round: each of `kept` (still running) gets what changed in its environment and goes
  // on in process; every other worker of `specs` starts as a new process, its files under
  // `attemptDir`. False, with `why` and nothing done, when a kept worker's identity (rank, world)
  // differs in `specs`: the caller then stops the group and starts a new one.
  // A worker replaced is the spare of its local rank in `spares` (a standby group, --standby)
  // where one waits with the identity it needs, else a new process.
  bool reform(const std::vector<WorkerSpec>& specs, const std::set<int>& kept, const std::string& attemptDir,
              std::string& why, WorkerGroup* spares = nullptr);
  std::vector<pid_t> pids() const;
  std::vector<WatchedWorker> watched() const;

  // What a failed worker left: its error file's message (TORCHELASTIC_ERROR_FILE), if any,
  // and the last lines of its stderr.
  std::optional<std::string> errorMessage(int localRank) const;
  std::string stderrTail(int localRank) const;

  // A standby group becomes the workers of `specs`: each worker's identity (rank, world, node,
  // restart count, program and arguments) must be what it was started with; the rest of the
  // environment (the round, the store, MASTER_PORT) goes to fsdp::init() over its pipe. False,
  // with `why` and nothing sent, when a worker has exited or an identity differs: the caller
  // starts fresh workers instead (destroying this group stops the standbys).
  bool activate(const std::vector<WorkerSpec>& specs, std::string& why);
  // A standby group: the spares that exited while they waited, since the last call, each once, as
  // "rank R (pid P) exited while it waited (<status>): <its error file's message, else its last
  // stderr line>". What they wrote goes where a worker's output goes; their error files are
  // removed, so that a process started in their place later does not inherit them.
  std::vector<std::string> exitedSpares();

 private:
  struct Stream {
    int fd = -1;           // read end of the pipe; -1 when not piped or closed
    int consoleFd = -1;    // 1 or 2, or -1 when this stream stays off the console
    int fileFd = -1;       // log file, or -1
    bool prefix = false;   // "[rank<N>]:" at the start of each console line
    bool atLineStart = true;
    bool keepTail = false;
  };
  struct Worker {
    WorkerSpec spec;
    std::optional<ChildProcess> process;
    Deadline::Clock::time_point started;
    Stream out;
    Stream err;
    std::deque<std::string> tail;  // last stderr lines
    std::string partial;           // stderr bytes after the last newline
    bool reported = false;         // reaped
    bool exitTold = false;         // its exit is in a reap() result already
    int activation = -1;           // a standby's pipe (write end) until activate()
    int control = -1;              // the control channel (agent's end), -1: none
    bool ready = false;            // it said it survives a failure elsewhere in process
    bool reforming = false;        // told to re-form in process, not re-formed yet
    bool deviceMemory = true;      // it may hold GPU memory (unless its program said not)
    // Exiting, and all it holds the kernel frees without anyone waiting for its reap.
    bool freesItselfUnreaped() const { return exitTold && !deviceMemory; }
    std::unique_ptr<LifelineWatch> lifeline;
    std::shared_ptr<flight::RingMemory> flight;
    std::shared_ptr<PyStackFile> pystacks;
  };
  // Starts workers_[index] from its spec (the constructor, and reform() for a worker replaced).
  void spawn(std::size_t index, bool standby);
  // reform(): workers_[index] becomes the spare of `spec`'s local rank in `spares`, activated with
  // `spec`'s round; false (nothing done) when none waits with the identity `spec` needs.
  bool adoptSpare(std::size_t index, const WorkerSpec& spec, WorkerGroup& spares);
  // reform(): what is left of workers_[index] goes (its process killed and reaped, or left to
  // reap() when it holds no GPU memory; its pipes).
  void clearSlot(std::size_t index);
  void readControl(Worker& w);
  void setUpStream(Worker& w, Stream& s, int bit, SpawnOptions& spawn);
  void readStream(Worker& w, Stream& s);
  void keepTail(Worker& w, const char* data, std::size_t n);
  void drainStreams(Worker& w);
  // The workers whose lifelines report them exiting, as exits.
  void takeLifelineNews(std::vector<WorkerExit>& exits);
  std::string dirOf(int localRank) const;

  std::vector<Worker> workers_;
  // Replaced workers still exiting (no GPU memory: nothing waits for them), reaped in reap().
  std::vector<ChildProcess> dying_;
  OutputOptions output_;
  std::string attemptDir_;
  Guardian& guardian_;
  bool control_ = false;
  int lifelineNews_[2] = {-1, -1};  // a pipe: each watcher writes its worker's index
};

// Writes all of `data` to fd (console or file); a console that went away is not an error.
void writeAll(int fd, const char* data, std::size_t n);
// The environment entries a standby must have been started with to become a worker.
extern const std::vector<const char*> kStandbyIdentity;

// A worker's environment ("KEY=VALUE" lines) as a map; the first of `keys` whose value differs
// between two (one line naming it, "" when none does); what `now` sets differently from `was`.
std::map<std::string, std::string> envMap(const std::vector<std::string>& env);
std::string identityChange(const std::map<std::string, std::string>& was, const std::map<std::string, std::string>& now,
                           const std::vector<const char*>& keys, int localRank);
nlohmann::json envChanges(const std::map<std::string, std::string>& was, const std::map<std::string, std::string>& now);

// The message in a torchrun-style error file: {"message": "..."} or
// {"message": {"message": "...", "extraInfo": {"py_callstack": "..."}}}. nullopt when the
// file is missing or unreadable.
std::optional<std::string> readErrorFile(const std::string& path);

}  // namespace fsdp::launcher::detail
