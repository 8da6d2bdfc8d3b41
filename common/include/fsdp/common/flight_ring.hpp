#pragma once
// A worker's flight recorder ring: the last collectives it issued (group, sequence number,
// operation, size, who asked, when issued, started and completed) and its progress marks, in a
// page range of shared memory that its agent maps too. The agent reads it while the worker
// runs, is frozen (SIGSTOP), sleeps uninterruptibly or is already dead: nothing here needs the
// worker's cooperation at read time.
//
// The agent makes the memfd (RingMemory::create) and hands each worker a duplicate
// (FSDPRUN_FLIGHT_FD); the worker maps it (RingMemory::attach) and is the only writer. Each
// slot carries a generation word (odd while being written): a reader copies a slot and keeps
// it only if the generation was even and unchanged, so a torn or overwritten slot is dropped,
// never misread. Times are CLOCK_REALTIME nanoseconds, comparable across the hosts of a job.
//
// Thread-safety: one writer thread per slot at a time (the recorder serialises issue()); any
// number of readers, in any process.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp::flight {

constexpr std::uint64_t kMagic = 0x31544c4650445346ull;  // "FSDPFLT1"
constexpr std::uint32_t kVersion = 3;
constexpr std::uint32_t kDefaultCapacity = 4096;

// kWait: a wait for other ranks outside a communicator (a checkpoint's commit, a snapshot
// restore's agreement, done through the store), recorded like a collective so that the hang
// report names who waits in it and who never entered it. Its `count` is the step it is for.
enum class Op : std::uint8_t { kNone = 0, kAllReduce, kAllGather, kReduceScatter, kBroadcast, kBarrier, kWait };
constexpr int kLastOp = static_cast<int>(Op::kWait);
const char* opName(Op op);  // "all_reduce", ...

enum class SlotState : std::uint8_t { kEmpty = 0, kIssued, kCompleted, kFailed };

struct alignas(64) Header {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t capacity;     // slots
  std::uint32_t slotBytes;    // sizeof(Slot)
  std::int32_t rank;          // -1 until a worker attached
  std::atomic<std::int64_t> pid;
  std::atomic<std::int64_t> attachedNs;  // when the worker attached (0: never)
  std::atomic<std::uint64_t> issued;     // slots ever written; the next goes to issued % capacity
  std::atomic<std::int64_t> progressCount;
  std::atomic<std::int64_t> progressStep;
  std::atomic<std::int64_t> progressNs;     // the last mark (0: none)
  std::atomic<std::int64_t> longestGapNs;   // the longest interval between two marks so far
  std::atomic<std::int64_t> lastCompletedNs;  // the newest completion of any collective
  std::atomic<std::int64_t> busySinceNs;    // inside a LongOperation since then (0: not)
  char progressWhat[24];                    // who marked last ("trainer step", ...)
  // Step timing (version 3), written by the worker at each step mark (markProgress with a step):
  // running totals since the worker attached, and the split of the last step (mark to mark).
  // Waiting in collectives is the time with at least one collective in flight (started, not
  // completed); data is the time the training thread waited for input; compute is the rest.
  std::atomic<std::int64_t> steps;          // step marks so far
  std::atomic<std::int64_t> stepNs;         // their total wall time (the first mark starts the clock)
  std::atomic<std::int64_t> waitNs;
  std::atomic<std::int64_t> dataNs;
  std::atomic<std::int64_t> lastStepNs;     // the last step: wall time and its parts
  std::atomic<std::int64_t> lastWaitNs;
  std::atomic<std::int64_t> lastDataNs;
  std::atomic<std::int64_t> bytes;          // bytes of every collective issued (the full tensor)
  std::atomic<std::int64_t> samples;        // this rank's samples and tokens, as the program reported
  std::atomic<std::int64_t> tokens;
  std::atomic<std::int64_t> lastSamples;    // in the last step
  std::atomic<std::int64_t> lastTokens;
  std::atomic<double> loss;                 // the last loss reported (NaN: none)
  std::atomic<double> straggler;            // compute / the median rank's, at the last report (0: none)
  char busyWhat[16];                        // what the long operation does ("checkpoint write"; no terminator at 16)
};

struct alignas(64) Slot {
  std::atomic<std::uint64_t> generation;  // 2*index+1 while written, 2*index+2 once written
  std::uint64_t seq;                      // per group, from 1
  std::int64_t count;                     // elements
  std::int64_t issuedNs;
  std::atomic<std::int64_t> startedNs;    // 0: not started
  std::atomic<std::int64_t> completedNs;  // 0: not completed
  std::atomic<std::uint8_t> state;        // SlotState
  Op op;
  std::uint32_t groupSize;                // ranks in the group
  std::uint32_t groupRank;
  char dtype[12];
  char group[24];
  char tag[48];
};
static_assert(sizeof(Slot) == 192);
static_assert(sizeof(Header) == 256);
static_assert(std::atomic<double>::is_always_lock_free);

// The bytes a ring of `capacity` slots takes.
std::size_t ringBytes(std::uint32_t capacity);

// One collective as read back.
struct Record {
  std::uint64_t index = 0;  // position in the worker's whole history
  std::uint64_t seq = 0;
  std::string group;
  int groupSize = 0;
  int groupRank = 0;
  Op op = Op::kNone;
  std::int64_t count = 0;
  std::string dtype;
  std::string tag;
  std::int64_t issuedNs = 0;
  std::int64_t startedNs = 0;
  std::int64_t completedNs = 0;
  SlotState state = SlotState::kEmpty;
};

// A worker's step timing and throughput as its ring says (Header, version 3).
struct StepTiming {
  std::int64_t steps = 0;
  std::int64_t stepNs = 0, waitNs = 0, dataNs = 0;              // totals
  std::int64_t lastStepNs = 0, lastWaitNs = 0, lastDataNs = 0;  // the last step
  std::int64_t bytes = 0, samples = 0, tokens = 0;
  std::int64_t lastSamples = 0, lastTokens = 0;
  double loss = 0;       // NaN: none reported
  double straggler = 0;  // 0: no report yet
  std::int64_t computeNs() const { return std::max<std::int64_t>(0, stepNs - waitNs - dataNs); }
  std::int64_t lastComputeNs() const { return std::max<std::int64_t>(0, lastStepNs - lastWaitNs - lastDataNs); }
};

struct Progress {
  std::int64_t count = 0;
  std::int64_t step = -1;
  std::int64_t lastNs = 0;
  std::int64_t longestGapNs = 0;
  std::string what;
  std::int64_t busySinceNs = 0;  // in a long operation (a checkpoint write) since then; 0: not
  std::string busyWhat;          // what it does, when busy ("checkpoint write")
};

// What a reader could take from a ring.
struct Reading {
  bool attached = false;      // a worker mapped it (a program without libfsdp never does)
  std::string error;          // why the ring cannot be read (corrupt header), "" when fine
  int rank = -1;
  std::int64_t pid = 0;
  std::int64_t attachedNs = 0;
  std::int64_t lastCompletedNs = 0;
  std::uint64_t issued = 0;   // collectives ever issued
  Progress progress;
  StepTiming timing;
  std::vector<Record> records;  // oldest first; torn or overwritten slots left out
};

// A mapping of one ring. Movable, unmaps and closes on destruction.
class RingMemory {
 public:
  // Agent side: a new zeroed ring of `capacity` slots in a memfd (close-on-exec). Throws Error.
  static RingMemory create(std::uint32_t capacity = kDefaultCapacity);
  // Worker side: maps the ring behind `fd` (taking ownership of fd) and validates its header.
  // nullopt, with `why`, when it is not a ring of this version.
  static std::optional<RingMemory> attach(int fd, std::string* why);
  // A ring in private memory (a worker started without an agent still records, for tests).
  static RingMemory anonymous(std::uint32_t capacity = kDefaultCapacity);

  RingMemory(RingMemory&& other) noexcept;
  RingMemory& operator=(RingMemory&& other) noexcept;
  RingMemory(const RingMemory&) = delete;
  RingMemory& operator=(const RingMemory&) = delete;
  ~RingMemory();

  int fd() const { return fd_; }
  Header& header() const { return *static_cast<Header*>(base_); }
  Slot& slot(std::uint64_t index) const;
  std::uint32_t capacity() const { return capacity_; }

  // Reads the ring: at most the newest `last` records. Never throws, whatever the bytes hold.
  Reading read(std::size_t last = kDefaultCapacity) const;

 private:
  RingMemory(int fd, void* base, std::size_t bytes, std::uint32_t capacity)
      : fd_(fd), base_(base), bytes_(bytes), capacity_(capacity) {}
  void release() noexcept;
  int fd_ = -1;
  void* base_ = nullptr;
  std::size_t bytes_ = 0;
  std::uint32_t capacity_ = 0;
};

// The writer's side: records into a ring it does not own.
class Writer {
 public:
  explicit Writer(const RingMemory& ring) : ring_(ring) {}
  // Marks the ring as this process's (rank, pid, now).
  void attach(int rank);
  struct Issue {
    std::string_view group;
    int groupSize = 0;
    int groupRank = 0;
    std::uint64_t seq = 0;
    Op op = Op::kNone;
    std::int64_t count = 0;
    std::string_view dtype;
    std::string_view tag;
  };
  // Writes a new slot (issued now, started when `started`); returns its index.
  std::uint64_t issue(const Issue& what, bool started);
  void start(std::uint64_t index);
  void complete(std::uint64_t index, bool ok);
  // A negative `step` marks activity and keeps the step last marked.
  void markProgress(std::int64_t step, std::string_view what);
  // Publishes the step timing (the writer keeps the running figures; see FlightRecorder).
  void publishTiming(const StepTiming& timing);
  void addBytes(std::int64_t bytes);
  // Enters (true) or leaves (false) a long operation that makes no collective or mark; `what`
  // says what it does (up to 16 characters).
  void setBusy(bool busy, std::string_view what = {});

 private:
  Slot* live(std::uint64_t index) const;  // nullptr when the slot was reused since
  const RingMemory& ring_;
};

std::int64_t nowNs();  // CLOCK_REALTIME

}  // namespace fsdp::flight
