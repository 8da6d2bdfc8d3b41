#pragma once
// Declarations shared by the checkpoint sources (checkpoint/*.cpp): the on-disk format's types,
// durable file I/O, the shard reader/writer, optimizer state. Private to libfsdp.

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/common/error.hpp"
#include "fsdp/worker/checkpoint.hpp"

namespace fsdp::worker::detail {

namespace fs = std::filesystem;
using nlohmann::json;

inline constexpr const char* kFormat = "fsdprun-sharded-checkpoint";
inline constexpr int kFormatVersion = 1;
inline constexpr const char* kLibraryVersion = "0.1.0";

// ---- names and dtypes (format.cpp) -------------------------------------------------------

std::string stepDirName(std::int64_t step);
// "step_" and eight digits: the names stepDirName makes (and nothing a user left beside them).
bool isStepDirName(const std::string& name);
std::string rankFileName(int rank);
std::string dtypeName(at::ScalarType t);
at::ScalarType parseDtype(const std::string& name, const std::string& where);

// ---- files (durable_io.cpp) --------------------------------------------------------------

// Owns a file descriptor.
class File {
 public:
  File(const std::string& path, int flags, mode_t mode = 0644) : path_(path) {
    fd_ = ::open(path.c_str(), flags | O_CLOEXEC, mode);
    if (fd_ < 0) throwErrno("opening " + path, errno);
  }
  // Adopts an open descriptor (an in-memory snapshot), named `name` in messages.
  File(int fd, std::string name) : path_(std::move(name)), fd_(fd) {}
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  void writeAll(const void* data, std::size_t n) {
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throwErrno("writing " + path_, errno);
      p += w;
      n -= static_cast<std::size_t>(w);
    }
  }
  void readAt(void* data, std::size_t n, std::uint64_t offset) const {
    auto* p = static_cast<char*>(data);
    while (n > 0) {
      const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throwErrno("reading " + path_, errno);
      if (r == 0) throw ConfigError("checkpoint file " + path_ + " is truncated (read past its end at byte " + std::to_string(offset) + ")");
      p += r;
      n -= static_cast<std::size_t>(r);
      offset += static_cast<std::uint64_t>(r);
    }
  }
  std::uint64_t size() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) throwErrno("stat " + path_, errno);
    return static_cast<std::uint64_t>(st.st_size);
  }
  void sync() {
    if (::fsync(fd_) != 0) throwErrno("fsync " + path_, errno);
  }

 private:
  std::string path_;
  int fd_ = -1;
};

void syncDirectory(const std::string& path);
void writeFileDurably(const std::string& path, std::string_view text);
std::string readText(const std::string& path);
std::uint32_t crc32Of(const void* data, std::size_t n);

// ---- optimizer state (optimizer_state.cpp) -----------------------------------------------

// The per-parameter state of the optimizers LibTorch ships, as named tensors and scalars.
struct OptimizerState {
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::int64_t> scalars;
};

std::string optimizerKind(const torch::optim::Optimizer& o);
std::optional<OptimizerState> readState(torch::optim::Optimizer& o, const std::string& kind,
                                        const at::Tensor& param);
void writeState(torch::optim::Optimizer& o, const std::string& kind, const at::Tensor& param,
                const OptimizerState& st);

// ---- the metadata (format.cpp) -----------------------------------------------------------

// One contiguous piece of a rank file: elements [start, start + count) of flat parameter
// `flat`'s `what` ("param", "optim/<name>"), or a whole "rng" / "buffer/<name>" blob.
struct Block {
  int flat = -1;
  std::string what;
  std::int64_t start = 0;
  std::int64_t count = 0;
  std::string dtype;
  std::vector<std::int64_t> shape;  // buffers
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  std::uint32_t crc = 0;
};

json blockJson(const Block& b);
Block blockFrom(const json& j);

struct ParamEntry {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;  // in its flat parameter
  std::int64_t numel = 0;
  int flat = 0;
};

// A checkpoint read from disk and checked for consistency (not yet the data).
struct Manifest {
  std::string path;
  json meta;
  int files = 0;                                  // rank files
  std::vector<std::uint64_t> fileBytes;           // expected size of each
  std::vector<std::vector<Block>> blocks;         // per rank file
  std::vector<std::int64_t> flatNumel;            // per flat
  std::vector<std::string> flatDtype;             // per flat (param blocks)
  std::map<std::string, ParamEntry> params;       // by name
  std::vector<std::string> paramOrder;
  std::string optimizerKind;                      // "" when none was saved
  std::vector<std::map<std::string, std::int64_t>> scalars;  // per flat
  bool checkCrc = true;  // false for sealed in-memory snapshots (nothing can change them)
};

Manifest readManifest(const std::string& path);
// The same from metadata already read (with its "files"); `path` names it in messages.
Manifest manifestFromMeta(json meta, const std::string& path);

// The optimizer state tensors a checkpoint holds per flat parameter (none without an optimizer).
// (optimizer_state.cpp)
std::vector<std::string> optimizerStateNames(const Manifest& m);

// ---- shard files (shard_file.cpp) --------------------------------------------------------

// Reads ranges of a checkpoint's data, opening each rank file once and checking its size.
class Reader {
 public:
  explicit Reader(const Manifest& m) : m_(m) {}

  // Reads file `index` from `file` instead of the checkpoint directory.
  void adopt(int index, std::unique_ptr<File> file) { files_[index] = std::move(file); }

  // File `index` is also mapped at `base` (`bytes` long; the pointer keeps the mapping): its
  // blocks may be viewed in place (view()) instead of read.
  void mapped(int index, std::shared_ptr<char> base, std::uint64_t bytes) { maps_[index] = {std::move(base), bytes}; }

  // Block `b` of file `index` as `like`'s shape and dtype, in place, without a copy: the block
  // must hold `like`'s first elements and the rest of `like`'s bytes (a shard's padding) must
  // lie in no other block. Undefined where that does not hold, the file is not mapped, or the
  // manifest wants CRCs checked (a view is not).
  at::Tensor view(int index, const Block& b, const at::Tensor& like) const;

  const File& file(int index) {
    auto& slot = files_[index];
    if (!slot) {
      const std::string path = m_.path + "/" + rankFileName(index);
      if (!fs::exists(path)) throw ConfigError("checkpoint file " + path + " is missing");
      slot = std::make_unique<File>(path, O_RDONLY);
      const auto size = slot->size();
      if (size != m_.fileBytes[static_cast<std::size_t>(index)]) {
        throw ConfigError("checkpoint file " + path + " has " + std::to_string(size) +
                          " bytes where its metadata says " +
                          std::to_string(m_.fileBytes[static_cast<std::size_t>(index)]) +
                          " (truncated or overwritten)");
      }
    }
    return *slot;
  }

  // Reads a whole block into dst (`bytes` long, which must be the block's size), checking its
  // CRC.
  void blockInto(int fileIndex, const Block& b, void* dst, std::size_t bytes) {
    const std::string where = "checkpoint file " + m_.path + "/" + rankFileName(fileIndex) + ": block '" + b.what + "'";
    if (bytes != b.bytes) {
      throw ConfigError(where + " has " + std::to_string(b.bytes) + " bytes where " + std::to_string(bytes) +
                        " are expected (its metadata does not match the data)");
    }
    file(fileIndex).readAt(dst, bytes, b.offset);
    if (m_.checkCrc && crc32Of(dst, bytes) != b.crc) {
      throw ConfigError(where + " at byte " + std::to_string(b.offset) + " fails its CRC-32 check (corrupt)");
    }
  }

  // A whole block as a new CPU tensor of `shape` and `dtype`.
  at::Tensor blockTensor(int fileIndex, const Block& b, at::IntArrayRef shape, at::ScalarType dtype) {
    auto t = at::empty(shape, at::TensorOptions().dtype(dtype));
    blockInto(fileIndex, b, t.data_ptr(), static_cast<std::size_t>(t.numel()) * t.element_size());
    return t;
  }

  // Fills dst (contiguous, elements of `elementBytes`) with elements [start, start + n) of flat
  // `flat`'s `what`, from whichever rank files hold them.
  void flatRange(int flat, const std::string& what, std::int64_t start, std::int64_t n, char* dst,
                 std::size_t elementBytes) {
    std::int64_t covered = 0;
    for (int fi = 0; fi < m_.files; ++fi) {
      for (const auto& b : m_.blocks[static_cast<std::size_t>(fi)]) {
        if (b.flat != flat || b.what != what) continue;
        const std::int64_t lo = std::max(start, b.start);
        const std::int64_t hi = std::min(start + n, b.start + b.count);
        if (lo >= hi) continue;
        char* out = dst + static_cast<std::size_t>(lo - start) * elementBytes;
        const std::size_t bytes = static_cast<std::size_t>(hi - lo) * elementBytes;
        if (lo == b.start && hi == b.start + b.count) {
          blockInto(fi, b, out, bytes);  // whole block: CRC checked
        } else {
          file(fi).readAt(out, bytes, b.offset + static_cast<std::uint64_t>(lo - b.start) * elementBytes);
        }
        covered += hi - lo;
      }
    }
    if (covered != n) {
      throw ConfigError("checkpoint " + m_.path + ": elements " + std::to_string(start) + ".." +
                        std::to_string(start + n) + " of flat parameter " + std::to_string(flat) +
                        " (" + what + ") are not in any rank file");
    }
  }

  // A parameter's elements [a, b) (in the parameter's own order) into dst.
  void paramRange(const ParamEntry& p, const std::string& what, std::int64_t a, std::int64_t b, char* dst,
                  std::size_t elementBytes) {
    flatRange(p.flat, what, p.offset + a, b - a, dst, elementBytes);
  }

 private:
  struct Mapping {
    std::shared_ptr<char> base;
    std::uint64_t bytes = 0;
  };
  const Manifest& m_;
  std::map<int, std::unique_ptr<File>> files_;
  std::map<int, Mapping> maps_;
};

// The module buffers saved (by rank 0, or by every rank in a snapshot), by name.
std::map<std::string, at::Tensor> readBuffers(Reader& reader, const Manifest& m);

// What one rank writes: blocks with their bytes (copies when asynchronous), in file order.
struct RankPlan {
  int rank = 0;
  std::vector<Block> blocks;
  std::vector<at::Tensor> data;  // contiguous CPU tensors, one per block
};

void addBlock(RankPlan& plan, Block b, at::Tensor data, bool copy);
// The module's buffers ("buffer/<name>" blocks). (save.cpp)
void addBuffers(RankPlan& plan, FullyShardedDataParallel& model, bool copy);

// What one rank saves of its training state: its plan (shards, optimizer state, RNG, and the
// module's buffers when `buffers`) and, when `withMeta`, the metadata that does not depend on
// the other ranks. `copy`: the plan holds copies (else views of the live tensors; device
// tensors are always copied to the host). (save.cpp)
struct RankState {
  RankPlan plan;
  json meta;
};
// `everyReplica`: save the shards even where this rank is not their primary replica (NO_SHARD,
// HYBRID_SHARD): a snapshot restores each rank from its own piece.
RankState describeRank(FullyShardedDataParallel& model, torch::optim::Optimizer* optimizer,
                       const TrainingProgress& progress, int rank, int world, bool copy, bool buffers,
                       bool withMeta, bool everyReplica = false);
// Sets the parts of describeRank's metadata that change from step to step: the progress and the
// optimizer's step counts, state names and learning rates. (A snapshot every step keeps the
// rest, the per-parameter table above all, from its first step.)
void refreshMeta(json& meta, const ShardLayout& layout, torch::optim::Optimizer* optimizer,
                 const TrainingProgress& progress);

// Collective. Loads `m` (read through `reader`) into the model, the optimizer and the RNG once
// every rank has read and checked its part; throws ConfigError on every rank (nothing changed)
// when any rank could not, or came with a `failure` of its own. (load.cpp)
// `keepOwnState`: this rank's shards and optimizer state already hold the manifest's step (a
// survivor of a re-formation whose state lies in that snapshot's memory): they are neither read
// nor written; the rest (buffers, RNG, learning rates) is. Where `reader` maps this rank's own
// file of the same world and layout, its shards and optimizer state become views of it (set_():
// no copy), block by block where Reader::view allows.
TrainingProgress loadManifest(Runtime& runtime, const Manifest& m, Reader& reader, FullyShardedDataParallel& model,
                              torch::optim::Optimizer* optimizer, const std::string& errorKey,
                              std::string failure = "", bool keepOwnState = false);
// Writes a rank's file (fsync'ed); fills offsets and CRCs of its blocks.
void writeRankFile(const std::string& path, RankPlan& plan);
json rankFileJson(const RankPlan& plan);

// ---- commit (commit.cpp) and pickles (pickle.cpp) ----------------------------------------

// Renames a fully written directory into place and keeps the newest `keep` checkpoints.
void commit(const std::string& dir, const std::string& tmp, const std::string& final, int keep);

// Writes a {name: tensor} pickle (what torch.load reads) through a temporary file and a rename.
void writePickle(const c10::Dict<std::string, at::Tensor>& dict, const std::string& path);

}  // namespace fsdp::worker::detail
