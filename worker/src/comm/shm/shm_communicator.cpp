// The shared-memory communicator: one segment per group, two staging slots per rank, one
// futex barrier per block. See shm_communicator.hpp for the design.
#include "fsdp/worker/shm_communicator.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/Functions.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstring>
#include <thread>
#include <vector>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/common/shm.hpp"
#include "comm/shm/shm_kernels.hpp"

namespace fsdp::worker {
namespace {

using detail::copyBytes;
using detail::kStreamBytes;
using detail::streamCopy;
using detail::sumFloats;

using Clock = std::chrono::steady_clock;
constexpr std::uint64_t kMagic = 0x66736470'73686d31ULL;  // "fsdpshm1"
constexpr std::size_t kLine = 64;
constexpr auto kSlice = std::chrono::milliseconds(100);  // how often a sleeper checks its peers
constexpr std::size_t kReasonBytes = 512;
constexpr std::uint32_t kWriting = 0x8000'0000U;

struct alignas(kLine) RankSlot {
  std::atomic<std::int32_t> pid;
  std::atomic<std::uint32_t> arrived;  // the last barrier generation this rank reached
};

// The start of the segment; RankSlot[size] follow, then the data slots (page aligned).
struct alignas(kLine) Header {
  std::uint64_t magic;
  std::uint32_t size;
  std::uint32_t reserved;
  std::uint64_t slotBytes;
  alignas(kLine) std::atomic<std::uint32_t> count;    // barrier arrivals, the futex word
  // 0; or 1 + the rank that gave up first, with kWriting set while it writes why into reason.
  alignas(kLine) std::atomic<std::uint32_t> aborted;
  char reason[kReasonBytes];
};

static_assert(std::atomic<std::uint32_t>::is_always_lock_free);
static_assert(std::atomic<std::int32_t>::is_always_lock_free);

std::size_t pageAlign(std::size_t n) { return (n + 4095) / 4096 * 4096; }
std::size_t dataOffset(int size) { return pageAlign(sizeof(Header) + sizeof(RankSlot) * static_cast<std::size_t>(size)); }

long futex(std::atomic<std::uint32_t>* word, int op, std::uint32_t value, const timespec* timeout) {
  return ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), op, value, timeout, nullptr, 0);
}

bool reached(std::uint32_t value, std::uint32_t target) {
  return static_cast<std::int32_t>(value - target) >= 0;
}

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}


// Thrown out of a collective; the Work handed back carries it.
[[noreturn]] void fail(bool timeout, const std::string& message) {
  if (timeout) throw TimeoutError(message);
  throw Error(message);
}

// The reason of a group given up by abort() (a re-formation), not by a failure.
const std::string kAbortMark = "abort: ";

bool processGone(std::int32_t pid) { return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH; }

class ShmCommunicator final : public Communicator {
 public:
  ShmCommunicator(void* base, std::size_t bytes, ShmOptions options)
      : base_(static_cast<char*>(base)), bytes_(bytes), options_(std::move(options)) {
    // Spinning helps only while every rank can run at once.
    const unsigned cores = std::max(1U, std::thread::hardware_concurrency());
    spins_ = static_cast<unsigned>(options_.size) <= cores ? 1000 : 50;
  }
  ~ShmCommunicator() override { ::munmap(base_, bytes_); }

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  c10::DeviceType deviceType() const override { return c10::DeviceType::CPU; }
  const char* backendName() const override { return "shared memory"; }

  Work allReduce(at::Tensor tensor, ReduceOp op) override {
    check(tensor, "allReduce");
    return run("allReduce", [&] {
      if (size() == 1 || tensor.numel() == 0) return;
      // In place: this rank's chunk of the tensor is reduced where it lies, then gathered.
      const auto flat = tensor.view({-1});
      const auto counts = chunkSizes(flat.numel(), size());
      const auto mine = flat.narrow(0, chunkOffsets(counts)[static_cast<std::size_t>(rank())],
                                    counts[static_cast<std::size_t>(rank())]);
      reduceScatterBlocks(flat, mine, counts, op, "allReduce");
      allGatherBlocks(mine, flat, counts, "allReduce");
    });
  }

  Work allGather(at::Tensor input, at::Tensor output) override {
    check(input, "allGather");
    check(output, "allGather");
    const auto counts = checkGatherSizes(input, output, rank(), size());
    return run("allGather", [&] {
      if (size() == 1) {
        output.view({-1}).copy_(input.view({-1}));
        return;
      }
      allGatherBlocks(input.view({-1}), output.view({-1}), counts, "allGather");
    });
  }

  Work reduceScatter(at::Tensor input, at::Tensor output, ReduceOp op) override {
    check(input, "reduceScatter");
    check(output, "reduceScatter");
    const auto counts = checkScatterSizes(input, output, rank(), size());
    return run("reduceScatter", [&] {
      if (size() == 1) {
        output.view({-1}).copy_(input.view({-1}));
        return;
      }
      reduceScatterBlocks(input.view({-1}), output.view({-1}), counts, op, "reduceScatter");
    });
  }

  Work broadcast(at::Tensor tensor, int root) override {
    check(tensor, "broadcast");
    if (root < 0 || root >= size()) {
      throw Error("broadcast: root " + std::to_string(root) + " is not a rank of 0.." + std::to_string(size() - 1));
    }
    return run("broadcast", [&] {
      if (size() == 1 || tensor.numel() == 0) return;
      const auto flat = tensor.view({-1});
      const std::int64_t element = flat.element_size();
      const std::int64_t block = static_cast<std::int64_t>(options_.slotBytes) / element;
      for (std::int64_t start = 0; start < flat.numel(); start += block) {
        const std::int64_t len = std::min(block, flat.numel() - start);
        char* slotRoot = slot(root);
        if (rank() == root) std::memcpy(slotRoot, bytesAt(flat, start), static_cast<std::size_t>(len * element));
        barrier("broadcast");
        if (rank() != root) std::memcpy(bytesAt(flat, start), slotRoot, static_cast<std::size_t>(len * element));
        flip();
      }
    });
  }

  Work barrier() override {
    return run("barrier", [&] {
      if (size() > 1) barrier("barrier");
    });
  }

 private:
  Header& header() const { return *reinterpret_cast<Header*>(base_); }
  RankSlot& rankSlot(int r) const {
    return reinterpret_cast<RankSlot*>(base_ + sizeof(Header))[static_cast<std::size_t>(r)];
  }
  // Rank r's staging slot for the current block.
  char* slot(int r) const {
    return base_ + dataOffset(size()) + (static_cast<std::size_t>(r) * 2 + buffer_) * options_.slotBytes;
  }
  void flip() { buffer_ ^= 1U; }
  static char* bytesAt(const at::Tensor& flat, std::int64_t index) {
    return static_cast<char*>(flat.data_ptr()) + index * flat.element_size();
  }

  void check(const at::Tensor& t, const char* op) const {
    if (!t.defined()) throw Error(std::string(op) + ": undefined tensor");
    if (!t.device().is_cpu()) {
      throw Error(std::string(op) + ": tensor on " + t.device().str() +
                  ", but the shared-memory communicator takes CPU tensors (use NCCL for CUDA)");
    }
    if (!t.is_contiguous()) throw Error(std::string(op) + ": tensor must be contiguous");
    switch (t.scalar_type()) {
      case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
      case at::kInt: case at::kLong: case at::kByte: case at::kChar: return;
      default:
        throw Error(std::string(op) + ": dtype " + c10::toString(t.scalar_type()) +
                    " is not supported by the shared-memory communicator (float32, float64, float16, "
                    "bfloat16, int8/32/64, uint8 are)");
    }
  }

  // Runs the operation now, on this thread; the Work carries its outcome. A failure leaves the
  // group aborted for every rank.
  template <typename Fn>
  Work run(const char* op, Fn&& fn) {
    return completedWork([&] {
      try {
        refuseIfAborted(op);
        fn();
      } catch (const std::exception& e) {
        giveUp(e.what());
        throw;
      }
    });
  }

  std::string who() const {
    return "rank " + std::to_string(rank()) + " of " + std::to_string(size()) + " (shared memory)";
  }

  void refuseIfAborted(const char* op) const {
    auto by = header().aborted.load(std::memory_order_acquire);
    if (by == 0) return;
    // The rank that gave up claimed the group before it wrote why: read the reason once it is
    // written (a CommAborted read as a failure would restart a survivor), unless that rank died
    // in between.
    for (const auto until = Clock::now() + std::chrono::seconds(1); (by & kWriting) != 0 && Clock::now() < until;) {
      std::this_thread::yield();
      by = header().aborted.load(std::memory_order_acquire);
    }
    const std::string reason = (by & kWriting) != 0 ? std::string("(it did not say why)")
                                                     : std::string(header().reason, strnlen(header().reason, kReasonBytes));
    by &= ~kWriting;
    const std::string message = std::string("shm ") + op + " on " + who() + ": the group was aborted by rank " +
                                std::to_string(by - 1) + ": " + reason;
    if (reason.starts_with(kAbortMark)) throw CommAborted(message);
    throw Error(message);
  }

  bool abort(const std::string& why) override {
    giveUp(kAbortMark + why);
    return true;
  }

  // The first rank to fail records why and wakes every sleeper.
  void giveUp(const std::string& why) {
    std::uint32_t expected = 0;
    const auto mine = static_cast<std::uint32_t>(rank()) + 1;
    if (header().aborted.compare_exchange_strong(expected, mine | kWriting, std::memory_order_acq_rel)) {
      std::strncpy(header().reason, why.c_str(), kReasonBytes - 1);
      header().aborted.store(mine, std::memory_order_release);
    }
    futex(&header().count, FUTEX_WAKE, INT_MAX, nullptr);
  }

  // Every rank arrives, then all go on. Spins briefly, then sleeps on the futex; every slice it
  // checks that the ranks it waits for are alive, that nobody gave up, and the deadline.
  void barrier(const char* op) {
    arrive();
    wait(op);
  }

  // A barrier in two halves, so that a rank can do its own work between them (arrive: "my
  // block is in my slot"; wait: "every block is in").
  void arrive() {
    ++generation_;
    rankSlot(rank()).arrived.store(static_cast<std::uint32_t>(generation_), std::memory_order_release);
    const auto target = static_cast<std::uint32_t>(generation_ * static_cast<std::uint64_t>(size()));
    if (header().count.fetch_add(1, std::memory_order_acq_rel) + 1 == target) {
      futex(&header().count, FUTEX_WAKE, INT_MAX, nullptr);
    }
  }

  void wait(const char* op) {
    const auto target = static_cast<std::uint32_t>(generation_ * static_cast<std::uint64_t>(size()));
    if (reached(header().count.load(std::memory_order_acquire), target)) return;
    for (unsigned i = 0; i < spins_; ++i) {
      if (reached(header().count.load(std::memory_order_acquire), target)) return;
      cpuRelax();
    }
    const auto deadline = Clock::now() + options_.timeout;
    for (;;) {
      const auto value = header().count.load(std::memory_order_acquire);
      if (reached(value, target)) return;
      refuseIfAborted(op);
      const timespec slice{0, std::chrono::nanoseconds(kSlice).count()};
      if (futex(&header().count, FUTEX_WAIT, value, &slice) == 0 || errno != ETIMEDOUT) continue;
      // A slice passed: who is missing, and are they still alive?
      std::string missing, dead;
      for (int r = 0; r < size(); ++r) {
        if (reached(rankSlot(r).arrived.load(std::memory_order_acquire), static_cast<std::uint32_t>(generation_))) continue;
        const auto pid = rankSlot(r).pid.load(std::memory_order_acquire);
        (missing.empty() ? missing : missing += ", ") += std::to_string(r);
        if (processGone(pid)) (dead.empty() ? dead : dead += ", ") += "rank " + std::to_string(r) + " (pid " + std::to_string(pid) + ")";
      }
      if (missing.empty()) continue;  // everyone is in; the last one's wake is on its way
      if (!dead.empty()) {
        fail(false, std::string("shm ") + op + " on " + who() + ": " + dead + " exited during the operation");
      }
      if (Clock::now() > deadline) {
        fail(true, std::string("shm ") + op + " on " + who() + " did not finish within " +
                       std::to_string(options_.timeout.count()) + " ms: rank(s) " + missing +
                       " never arrived (stopped, or issuing different operations)");
      }
    }
  }

  // Reduces `a` (+)= `b` element-wise into `out` (all the same length), with fp32 accumulation
  // for 16-bit types done by the caller.
  static void combine(at::Tensor& acc, const at::Tensor& piece, ReduceOp op) {
    switch (op) {
      case ReduceOp::kMin: at::minimum_out(acc, acc, piece); break;
      case ReduceOp::kMax: at::maximum_out(acc, acc, piece); break;
      case ReduceOp::kSum:
      case ReduceOp::kAverage: acc.add_(piece); break;
    }
  }

  // Block by block: every rank copies, for each other destination, its next block of that
  // destination's chunk into its slot; one barrier; every rank reduces its own chunk's block
  // from the others' slots and its own input into `output`, in rank order.
  void reduceScatterBlocks(const at::Tensor& input, const at::Tensor& output,
                           const std::vector<std::int64_t>& counts, ReduceOp op, const char* name) {
    const int n = size();
    const std::int64_t element = input.element_size();
    const std::int64_t block = static_cast<std::int64_t>(options_.slotBytes) / (element * n);
    const auto offsets = chunkOffsets(counts);
    const std::int64_t longest = *std::max_element(counts.begin(), counts.end());
    const auto type = input.scalar_type();
    const bool wide = type == at::kHalf || type == at::kBFloat16;
    const auto viewOf = [&](char* p, std::int64_t len) {
      return at::from_blob(p, {len}, at::TensorOptions().dtype(type));
    };
    const std::int64_t mine = counts[static_cast<std::size_t>(rank())];
    // allReduce reduces each rank's chunk where it lies: output is input's own chunk.
    const bool inPlace = output.data_ptr() == bytesAt(input, offsets[static_cast<std::size_t>(rank())]);
    // Large float32 sums and averages over a power-of-two group: one fused, streaming pass.
    const bool fused = !inPlace && type == at::kFloat && output.nbytes() >= kStreamBytes &&
                       (op == ReduceOp::kSum || (op == ReduceOp::kAverage && (n & (n - 1)) == 0));
    for (std::int64_t start = 0; start < longest; start += block) {
      char* own = slot(rank());
      for (int d = 0; d < n; ++d) {
        const std::int64_t len = std::clamp<std::int64_t>(counts[static_cast<std::size_t>(d)] - start, 0, block);
        if (len > 0 && d != rank()) {  // this rank reads its own piece from its input
          std::memcpy(own + static_cast<std::size_t>(d) * block * element,
                      bytesAt(input, offsets[static_cast<std::size_t>(d)] + start), static_cast<std::size_t>(len * element));
        }
      }
      barrier(name);
      const std::int64_t len = std::clamp<std::int64_t>(mine - start, 0, block);
      if (len > 0) {
        const auto piece = [&](int j) {
          if (j == rank()) return input.narrow(0, offsets[static_cast<std::size_t>(j)] + start, len);
          return viewOf(slot(j) + static_cast<std::size_t>(rank()) * block * element, len);
        };
        auto out = output.narrow(0, start, len);
        // This rank's piece first, then the others in rank order.
        if (wide) {
          auto acc = piece(rank()).to(at::kFloat);
          for (int j = 0; j < n; ++j) {
            if (j != rank()) combine(acc, piece(j), op);  // promotes to fp32
          }
          if (op == ReduceOp::kAverage) acc.div_(n);
          out.copy_(acc);
        } else if (fused) {
          // Own piece, then the others in rank order: the order of the path below.
          std::vector<const float*> terms{static_cast<const float*>(piece(rank()).data_ptr())};
          for (int j = 0; j < n; ++j) {
            if (j != rank()) terms.push_back(static_cast<const float*>(piece(j).data_ptr()));
          }
          sumFloats(static_cast<float*>(out.data_ptr()), terms.data(), n,
                    op == ReduceOp::kAverage ? static_cast<float>(n) : 1.0F, len);
        } else {
          int done = rank();
          if (!inPlace) {
            if (op == ReduceOp::kSum || op == ReduceOp::kAverage) {
              done = rank() == 0 ? 1 : 0;
              at::add_out(out, piece(rank()), piece(done));  // one pass for the first two
            } else {
              out.copy_(piece(rank()));
            }
          }
          for (int j = 0; j < n; ++j) {
            if (j != rank() && j != done) combine(out, piece(j), op);
          }
          if (op == ReduceOp::kAverage) out.div_(n);
        }
      }
      flip();
    }
  }

  // Block by block: every rank copies its next block into its slot; one barrier; every rank
  // copies the others' blocks into place.
  void allGatherBlocks(const at::Tensor& input, const at::Tensor& output,
                       const std::vector<std::int64_t>& counts, const char* name) {
    const int n = size();
    const std::int64_t element = input.element_size();
    const std::int64_t block = static_cast<std::int64_t>(options_.slotBytes) / element;
    const auto offsets = chunkOffsets(counts);
    const std::int64_t longest = *std::max_element(counts.begin(), counts.end());
    const std::int64_t mine = counts[static_cast<std::size_t>(rank())];
    const bool inPlace = input.data_ptr() == bytesAt(output, offsets[static_cast<std::size_t>(rank())]);
    const auto copyOut = output.nbytes() >= kStreamBytes ? &streamCopy : &copyBytes;
    for (std::int64_t start = 0; start < longest; start += block) {
      const std::int64_t len = std::clamp<std::int64_t>(mine - start, 0, block);
      if (len > 0) std::memcpy(slot(rank()), bytesAt(input, start), static_cast<std::size_t>(len * element));
      arrive();
      // This rank's own block goes straight from input to output while the others catch up.
      if (len > 0 && !inPlace) {
        copyOut(bytesAt(output, offsets[static_cast<std::size_t>(rank())] + start), bytesAt(input, start),
                static_cast<std::size_t>(len * element));
      }
      wait(name);
      for (int j = 0; j < n; ++j) {
        if (j == rank()) continue;
        const std::int64_t theirs = std::clamp<std::int64_t>(counts[static_cast<std::size_t>(j)] - start, 0, block);
        if (theirs > 0) {
          copyOut(bytesAt(output, offsets[static_cast<std::size_t>(j)] + start), slot(j), static_cast<std::size_t>(theirs * element));
        }
      }
      flip();
    }
  }

  char* base_;
  std::size_t bytes_;
  ShmOptions options_;
  std::uint64_t generation_ = 0;  // barriers passed; the same on every rank
  unsigned buffer_ = 0;           // which of the two slots the next block uses
  unsigned spins_ = 0;
};

// Closes a descriptor on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::unique_ptr<Communicator> createShmCommunicator(rendezvous::StoreClient& store, const ShmOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    throw ConfigError("shared-memory communicator: rank " + std::to_string(options.rank) +
                      " is not in a world of size " + std::to_string(options.size));
  }
  if (options.slotBytes < 4096 || options.slotBytes % 64 != 0) {
    throw ConfigError("shared-memory communicator: slot of " + std::to_string(options.slotBytes) +
                      " bytes: expected a multiple of 64, at least 4096");
  }
  const std::size_t bytes = dataOffset(options.size) + static_cast<std::size_t>(options.size) * 2 * options.slotBytes;
  const std::string nameKey = options.storePrefix + "/segment";
  const std::string who = "rank " + std::to_string(options.rank) + " of " + std::to_string(options.size);
  std::string name;
  Fd fd;
  if (options.rank == 0) {
    static std::atomic<unsigned> counter{0};
    // Under fsdprun the parent is the agent, which removes what a crash before the unlink leaves.
    name = "/" + shmSegmentPrefix(options.runId, ::getppid()) + std::to_string(::getpid()) + "-" +
           std::to_string(counter++);
    fd.fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    int err = fd.fd < 0 ? errno : 0;
    // fallocate, not ftruncate: /dev/shm too small (a container's 64 MB) is an error here, not
    // a SIGBUS in the middle of a collective.
    if (err == 0) err = ::posix_fallocate(fd.fd, 0, static_cast<off_t>(bytes));
    if (err != 0) {
      if (fd.fd >= 0) ::shm_unlink(name.c_str());
      const std::string why = errnoMessage("cannot make a shared-memory segment of " + std::to_string(bytes >> 20) +
                                               " MB in /dev/shm (a container's --shm-size?)",
                                           err);
      store.set(nameKey, "!" + why);  // the others learn it instead of waiting
      throw ConfigError("shared-memory communicator on " + who + ": " + why);
    }
  } else {
    name = store.get(nameKey, options.timeout);
    if (!name.empty() && name.front() == '!') {
      throw ConfigError("shared-memory communicator on " + who + ": rank 0 " + name.substr(1));
    }
    fd.fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
    if (fd.fd < 0) throw Error(errnoMessage("shared-memory communicator on " + who + ": shm_open " + name, errno));
    struct stat st {};
    if (::fstat(fd.fd, &st) != 0 || static_cast<std::size_t>(st.st_size) != bytes) {
      throw Error("shared-memory communicator on " + who + ": segment " + name + " has " +
                  std::to_string(st.st_size) + " bytes, expected " + std::to_string(bytes) +
                  " (ranks disagree on the group's size or slot size)");
    }
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.fd, 0);
  if (base == MAP_FAILED) {
    if (options.rank == 0) ::shm_unlink(name.c_str());
    throw Error(errnoMessage("shared-memory communicator on " + who + ": mmap of " + name, errno));
  }
  auto* header = static_cast<Header*>(base);
  if (options.rank == 0) {
    // Fresh pages are zero: the atomics start at 0 as constructed.
    header->size = static_cast<std::uint32_t>(options.size);
    header->slotBytes = options.slotBytes;
    header->magic = kMagic;
    store.set(nameKey, name);
  } else if (header->magic != kMagic || header->size != static_cast<std::uint32_t>(options.size) ||
             header->slotBytes != options.slotBytes) {
    ::munmap(base, bytes);
    throw Error("shared-memory communicator on " + who + ": segment " + name +
                " does not belong to this group (size or slot size differ)");
  }
  auto* ranks = reinterpret_cast<RankSlot*>(static_cast<char*>(base) + sizeof(Header));
  ranks[options.rank].pid.store(static_cast<std::int32_t>(::getpid()), std::memory_order_release);
  auto communicator = std::make_unique<ShmCommunicator>(base, bytes, options);
  try {
    store.addAndWait(options.storePrefix + "/attached", 1, options.size, options.timeout);
  } catch (const Error& e) {
    if (options.rank == 0) ::shm_unlink(name.c_str());
    throw TimeoutError("shared-memory communicator on " + who + ": not every rank attached within " +
                       std::to_string(options.timeout.count()) + " ms (" + e.what() + ")");
  }
  // Every rank has it mapped: the name can go, and with it anything a crash could leave.
  if (options.rank == 0) ::shm_unlink(name.c_str());
  log::debug("shared-memory communicator: {} attached to {} ({} MB)", who, name, bytes >> 20);
  return communicator;
}

}  // namespace fsdp::worker
