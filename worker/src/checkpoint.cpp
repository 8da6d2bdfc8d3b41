#include "fsdp/worker/checkpoint.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/worker/runtime.hpp"

namespace fsdp::worker {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kFormat = "fsdprun-sharded-checkpoint";
constexpr int kFormatVersion = 1;
constexpr const char* kLibraryVersion = "0.1.0";

std::string stepDirName(std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step_%08lld", static_cast<long long>(step));
  return name;
}

// "step_" and eight digits: the names stepDirName makes (and nothing a user left beside them).
bool isStepDirName(const std::string& name) {
  return name.size() == 13 && name.starts_with("step_") &&
         std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The committed checkpoints of `dir`, oldest first (the names sort by step).
std::vector<std::string> completeCheckpoints(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> complete;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (isStepDirName(entry.path().filename().string()) && fs::exists(entry.path() / "COMMIT")) {
      complete.push_back(entry.path().string());
    }
  }
  std::sort(complete.begin(), complete.end());
  return complete;
}

std::string rankFileName(int rank) {
  char name[32];
  std::snprintf(name, sizeof(name), "rank_%05d.bin", rank);
  return name;
}

// ---- dtypes ------------------------------------------------------------------------------

std::string dtypeName(at::ScalarType t) { return c10::toString(t); }

at::ScalarType parseDtype(const std::string& name, const std::string& where) {
  for (const auto t : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt,
                       at::kShort, at::kChar, at::kByte, at::kBool}) {
    if (dtypeName(t) == name) return t;
  }
  throw ConfigError(where + ": unknown dtype '" + name + "'");
}

// ---- files -------------------------------------------------------------------------------

// Owns a file descriptor.
class File {
 public:
  File(const std::string& path, int flags, mode_t mode = 0644) : path_(path) {
    fd_ = ::open(path.c_str(), flags | O_CLOEXEC, mode);
    if (fd_ < 0) throwErrno("opening " + path, errno);
  }
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

void syncDirectory(const std::string& path) {
  File dir(path, O_RDONLY | O_DIRECTORY);
  dir.sync();
}

void writeFileDurably(const std::string& path, std::string_view text) {
  File f(path, O_WRONLY | O_CREAT | O_TRUNC);
  f.writeAll(text.data(), text.size());
  f.sync();
}

std::string readText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("checkpoint: cannot read " + path + " (" + std::strerror(errno) + ")");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::uint32_t crc32Of(const void* data, std::size_t n) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(data);
  while (n > 0) {
    const auto chunk = static_cast<uInt>(std::min<std::size_t>(n, 1u << 30));
    crc = ::crc32(crc, p, chunk);
    p += chunk;
    n -= chunk;
  }
  return static_cast<std::uint32_t>(crc);
}

// ---- optimizer state ---------------------------------------------------------------------

// The per-parameter state of the optimizers LibTorch ships, as named tensors and scalars.
struct OptimizerState {
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::int64_t> scalars;
};

std::string optimizerKind(const torch::optim::Optimizer& o) {
  if (dynamic_cast<const torch::optim::AdamW*>(&o)) return "adamw";
  if (dynamic_cast<const torch::optim::Adam*>(&o)) return "adam";
  if (dynamic_cast<const torch::optim::SGD*>(&o)) return "sgd";
  if (dynamic_cast<const torch::optim::RMSprop*>(&o)) return "rmsprop";
  if (dynamic_cast<const torch::optim::Adagrad*>(&o)) return "adagrad";
  throw ConfigError("checkpoint: the state of this optimizer cannot be saved (Adam, AdamW, SGD, "
                    "RMSprop and Adagrad can; LBFGS keeps history that does not shard)");
}

std::string stateKey(const at::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }

std::optional<OptimizerState> readState(torch::optim::Optimizer& o, const std::string& kind,
                                        const at::Tensor& param) {
  auto& states = o.state();
  const auto it = states.find(stateKey(param));
  if (it == states.end()) return std::nullopt;
  OptimizerState out;
  const auto put = [&out](const char* name, const at::Tensor& t) {
    if (t.defined()) out.tensors[name] = t;
  };
  // Adam's and AdamW's states are unrelated types with the same fields.
  const auto adamLike = [&](const auto& s) {
    out.scalars["step"] = s.step();
    put("exp_avg", s.exp_avg());
    put("exp_avg_sq", s.exp_avg_sq());
    put("max_exp_avg_sq", s.max_exp_avg_sq());
  };
  if (kind == "adam") {
    adamLike(static_cast<const torch::optim::AdamParamState&>(*it->second));
  } else if (kind == "adamw") {
    adamLike(static_cast<const torch::optim::AdamWParamState&>(*it->second));
  } else if (kind == "sgd") {
    put("momentum_buffer", static_cast<const torch::optim::SGDParamState&>(*it->second).momentum_buffer());
  } else if (kind == "rmsprop") {
    const auto& s = static_cast<const torch::optim::RMSpropParamState&>(*it->second);
    out.scalars["step"] = s.step();
    put("square_avg", s.square_avg());
    put("momentum_buffer", s.momentum_buffer());
    put("grad_avg", s.grad_avg());
  } else if (kind == "adagrad") {
    const auto& s = static_cast<const torch::optim::AdagradParamState&>(*it->second);
    out.scalars["step"] = s.step();
    put("sum", s.sum());
  }
  return out;
}

void writeState(torch::optim::Optimizer& o, const std::string& kind, const at::Tensor& param,
                const OptimizerState& st) {
  const auto get = [&st](const char* name) {
    const auto it = st.tensors.find(name);
    return it == st.tensors.end() ? at::Tensor() : it->second;
  };
  const auto scalar = [&st](const char* name) {
    const auto it = st.scalars.find(name);
    return it == st.scalars.end() ? 0 : it->second;
  };
  std::unique_ptr<torch::optim::OptimizerParamState> state;
  const auto adamLike = [&](auto s) {
    s->step(scalar("step")).exp_avg(get("exp_avg")).exp_avg_sq(get("exp_avg_sq"));
    if (get("max_exp_avg_sq").defined()) s->max_exp_avg_sq(get("max_exp_avg_sq"));
    state = std::move(s);
  };
  if (kind == "adam") {
    adamLike(std::make_unique<torch::optim::AdamParamState>());
  } else if (kind == "adamw") {
    adamLike(std::make_unique<torch::optim::AdamWParamState>());
  } else if (kind == "sgd") {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(get("momentum_buffer"));
    state = std::move(s);
  } else if (kind == "rmsprop") {
    auto s = std::make_unique<torch::optim::RMSpropParamState>();
    s->step(scalar("step")).square_avg(get("square_avg"));
    if (get("momentum_buffer").defined()) s->momentum_buffer(get("momentum_buffer"));
    if (get("grad_avg").defined()) s->grad_avg(get("grad_avg"));
    state = std::move(s);
  } else if (kind == "adagrad") {
    auto s = std::make_unique<torch::optim::AdagradParamState>();
    s->step(scalar("step")).sum(get("sum"));
    state = std::move(s);
  } else {
    throw ConfigError("checkpoint: unknown optimizer kind '" + kind + "'");
  }
  o.state()[stateKey(param)] = std::move(state);
}

// ---- the metadata ------------------------------------------------------------------------

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

json blockJson(const Block& b) {
  json j{{"what", b.what}, {"offset", b.offset}, {"bytes", b.bytes}, {"crc32", b.crc}};
  if (b.flat >= 0) {
    j["flat"] = b.flat;
    j["start"] = b.start;
    j["count"] = b.count;
  }
  if (!b.dtype.empty()) j["dtype"] = b.dtype;
  if (!b.shape.empty()) j["shape"] = b.shape;
  return j;
}

Block blockFrom(const json& j) {
  Block b;
  b.what = j.at("what").get<std::string>();
  b.offset = j.at("offset").get<std::uint64_t>();
  b.bytes = j.at("bytes").get<std::uint64_t>();
  b.crc = j.at("crc32").get<std::uint32_t>();
  b.flat = j.value("flat", -1);
  b.start = j.value("start", std::int64_t{0});
  b.count = j.value("count", std::int64_t{0});
  b.dtype = j.value("dtype", std::string());
  if (j.contains("shape")) b.shape = j["shape"].get<std::vector<std::int64_t>>();
  return b;
}

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
};

Manifest readManifest(const std::string& path) {
  Manifest m;
  m.path = path;
  const std::string metaPath = path + "/metadata.json";
  if (!fs::exists(path + "/COMMIT")) {
    throw ConfigError("checkpoint " + path + " is incomplete: it has no COMMIT marker");
  }
  if (!fs::exists(metaPath)) throw ConfigError("checkpoint " + path + ": " + metaPath + " is missing");
  try {
    m.meta = json::parse(readText(metaPath));
    if (m.meta.at("format").get<std::string>() != kFormat) {
      throw ConfigError("checkpoint " + metaPath + ": not an fsdprun sharded checkpoint");
    }
    if (m.meta.at("format_version").get<int>() > kFormatVersion) {
      throw ConfigError("checkpoint " + metaPath + ": format version " +
                        std::to_string(m.meta.at("format_version").get<int>()) +
                        " is newer than this library's (" + std::to_string(kFormatVersion) + ")");
    }
    const auto& flats = m.meta.at("flats");
    for (std::size_t f = 0; f < flats.size(); ++f) {
      m.flatNumel.push_back(flats[f].at("numel").get<std::int64_t>());
      m.flatDtype.push_back(flats[f].at("dtype").get<std::string>());
      for (const auto& p : flats[f].at("params")) {
        ParamEntry e{p.at("name").get<std::string>(), p.at("shape").get<std::vector<std::int64_t>>(),
                     p.at("offset").get<std::int64_t>(), p.at("numel").get<std::int64_t>(), static_cast<int>(f)};
        m.paramOrder.push_back(e.name);
        m.params[e.name] = std::move(e);
      }
    }
    const auto& files = m.meta.at("files");
    m.files = static_cast<int>(files.size());
    for (const auto& file : files) {
      m.fileBytes.push_back(file.at("bytes").get<std::uint64_t>());
      auto& list = m.blocks.emplace_back();
      for (const auto& b : file.at("blocks")) list.push_back(blockFrom(b));
    }
    if (m.meta.contains("optimizer") && !m.meta["optimizer"].is_null()) {
      m.optimizerKind = m.meta["optimizer"].at("kind").get<std::string>();
      for (const auto& s : m.meta["optimizer"].at("scalars")) {
        m.scalars.push_back(s.get<std::map<std::string, std::int64_t>>());
      }
    }
  } catch (const json::exception& e) {
    throw ConfigError("checkpoint " + metaPath + " is malformed: " + e.what());
  }
  return m;
}

// The optimizer state tensors a checkpoint holds per flat parameter (none without an optimizer).
std::vector<std::string> optimizerStateNames(const Manifest& m) {
  if (m.optimizerKind.empty()) return {};
  return m.meta["optimizer"].at("state").get<std::vector<std::string>>();
}

// Reads ranges of a checkpoint's data, opening each rank file once and checking its size.
class Reader {
 public:
  explicit Reader(const Manifest& m) : m_(m) {}

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
    if (crc32Of(dst, bytes) != b.crc) {
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
  const Manifest& m_;
  std::map<int, std::unique_ptr<File>> files_;
};

// The module buffers rank 0 saved, by name.
std::map<std::string, at::Tensor> readBuffers(Reader& reader, const Manifest& m) {
  std::map<std::string, at::Tensor> buffers;
  if (m.blocks.empty()) return buffers;
  for (const auto& b : m.blocks[0]) {
    if (!b.what.starts_with("buffer/")) continue;
    buffers[b.what.substr(7)] = reader.blockTensor(0, b, b.shape, parseDtype(b.dtype, m.path));
  }
  return buffers;
}

// Writes a {name: tensor} pickle (what torch.load reads) through a temporary file and a rename.
void writePickle(const c10::Dict<std::string, at::Tensor>& dict, const std::string& path) {
  const auto bytes = torch::pickle_save(c10::IValue(dict));
  const std::string tmp = path + ".tmp";
  writeFileDurably(tmp, {bytes.data(), bytes.size()});
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) throw Error("renaming " + tmp + " to " + path + ": " + ec.message());
}

// Checks that the model's parameters are the checkpoint's: the same names, shapes and dtypes.
void checkModelFits(const Manifest& m, const ShardLayout& layout) {
  std::set<std::string> seen;
  for (const auto& flat : layout.flats) {
    for (const auto& p : flat.params) {
      const auto it = m.params.find(p.name);
      if (it == m.params.end()) {
        throw ConfigError("checkpoint " + m.path + " does not fit this model: it has no parameter '" +
                          p.name + "' (wrong model?)");
      }
      if (it->second.shape != p.shape) {
        std::ostringstream text;
        text << "checkpoint " << m.path << " does not fit this model: parameter '" << p.name
             << "' has shape " << at::IntArrayRef(it->second.shape) << " there but "
             << at::IntArrayRef(p.shape) << " here";
        throw ConfigError(text.str());
      }
      const auto dtype = m.flatDtype[static_cast<std::size_t>(it->second.flat)];
      if (dtype != dtypeName(flat.shard.scalar_type())) {
        throw ConfigError("checkpoint " + m.path + " does not fit this model: parameter '" + p.name +
                          "' is " + dtype + " there but " + dtypeName(flat.shard.scalar_type()) + " here");
      }
      seen.insert(p.name);
    }
  }
  for (const auto& name : m.paramOrder) {
    if (!seen.contains(name)) {
      throw ConfigError("checkpoint " + m.path + " does not fit this model: the model has no parameter '" +
                        name + "' (wrong model?)");
    }
  }
}

// Fills `dst` (this rank's shard layout of one flat parameter) with `what` from the checkpoint.
// Parameters that lie back to back in the same saved flat parameter are read as one range, so
// at the saved layout every read is a whole block (and its CRC is checked).
void fillShard(Reader& reader, const Manifest& m, const FlatParamInfo& flat, const std::string& what,
               const at::Tensor& dst) {
  const std::size_t elementBytes = dst.element_size();
  auto* base = static_cast<char*>(dst.data_ptr());
  const std::int64_t a = flat.shardOffset;
  const std::int64_t b = std::min(flat.shardOffset + flat.shardNumel, flat.numel);
  struct Range {
    int oldFlat;
    std::int64_t oldStart;
    std::int64_t length;
    std::int64_t dstStart;  // in elements of dst
  };
  std::vector<Range> ranges;
  for (const auto& p : flat.params) {
    const std::int64_t lo = std::max(a, p.offset);
    const std::int64_t hi = std::min(b, p.offset + p.numel);
    if (lo >= hi) continue;
    const auto& saved = m.params.at(p.name);
    const Range r{saved.flat, saved.offset + (lo - p.offset), hi - lo, lo - a};
    if (!ranges.empty()) {
      auto& last = ranges.back();
      if (last.oldFlat == r.oldFlat && last.oldStart + last.length == r.oldStart &&
          last.dstStart + last.length == r.dstStart) {
        last.length += r.length;
        continue;
      }
    }
    ranges.push_back(r);
  }
  for (const auto& r : ranges) {
    reader.flatRange(r.oldFlat, what, r.oldStart, r.length, base + static_cast<std::size_t>(r.dstStart) * elementBytes,
                     elementBytes);
  }
}

// What one rank writes: blocks with their bytes (copies when asynchronous), in file order.
struct RankPlan {
  int rank = 0;
  std::vector<Block> blocks;
  std::vector<at::Tensor> data;  // contiguous CPU tensors, one per block
};

void addBlock(RankPlan& plan, Block b, at::Tensor data, bool copy) {
  // One copy at most: a device tensor's copy to the host is already the snapshot.
  data = data.to(at::kCPU, data.scalar_type(), /*non_blocking=*/false, /*copy=*/copy).contiguous();
  b.bytes = static_cast<std::uint64_t>(data.numel()) * data.element_size();
  if (b.dtype.empty()) b.dtype = dtypeName(data.scalar_type());
  plan.blocks.push_back(std::move(b));
  plan.data.push_back(std::move(data));
}

// Writes a rank's file (fsync'ed); fills offsets and CRCs of its blocks.
void writeRankFile(const std::string& path, RankPlan& plan) {
  File out(path, O_WRONLY | O_CREAT | O_TRUNC);
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
    auto& b = plan.blocks[i];
    const auto* bytes = plan.data[i].data_ptr();
    b.offset = offset;
    b.crc = crc32Of(bytes, b.bytes);
    out.writeAll(bytes, b.bytes);
    offset += b.bytes;
  }
  out.sync();
}

json rankFileJson(const RankPlan& plan) {
  std::uint64_t bytes = 0;
  json blocks = json::array();
  for (const auto& b : plan.blocks) {
    blocks.push_back(blockJson(b));
    bytes += b.bytes;
  }
  return json{{"rank", plan.rank}, {"bytes", bytes}, {"blocks", blocks}};
}

// Renames a fully written directory into place and keeps the newest `keep` checkpoints.
void commit(const std::string& dir, const std::string& tmp, const std::string& final, int keep) {
  writeFileDurably(tmp + "/COMMIT", "complete\n");
  syncDirectory(tmp);
  std::error_code ec;
  if (fs::exists(final)) fs::remove_all(final, ec);  // the same step saved by an earlier attempt
  fs::rename(tmp, final, ec);
  if (ec) throw Error("checkpoint: renaming " + tmp + " to " + final + ": " + ec.message());
  syncDirectory(dir);
  // Unfinished directories of this step or older ones (earlier attempts). Newer ones stay:
  // with asynchronous saves, another rank may already be writing the next step.
  const std::string committed = fs::path(final).filename().string();
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with(".step_") && name.substr(1, committed.size()) <= committed) {
      fs::remove_all(entry.path(), ec);
    }
  }
  // Complete checkpoints beyond `keep`.
  const auto complete = completeCheckpoints(dir);
  if (keep > 0 && static_cast<int>(complete.size()) > keep) {
    for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < complete.size(); ++i) {
      fs::remove_all(complete[i], ec);
    }
  }
}

}  // namespace

// ---- Checkpointer -------------------------------------------------------------------------

Checkpointer::Checkpointer(Runtime& runtime, CheckpointOptions options)
    : runtime_(runtime), options_(std::move(options)) {
  std::error_code ec;
  fs::create_directories(options_.dir, ec);
  if (ec || !fs::is_directory(options_.dir)) {
    throw ConfigError("--checkpoint_dir '" + options_.dir + "': cannot create it (" +
                      (ec ? ec.message() : "not a directory") + ")");
  }
}

Checkpointer::~Checkpointer() {
  if (writer_.joinable()) writer_.join();
  if (writerError_) {
    try {
      std::rethrow_exception(writerError_);
    } catch (const std::exception& e) {
      log::error("an asynchronous checkpoint save failed: {}", e.what());
    }
  }
}

void Checkpointer::wait() {
  if (writer_.joinable()) writer_.join();
  if (writerError_) std::rethrow_exception(std::exchange(writerError_, nullptr));
}

void Checkpointer::save(FullyShardedDataParallel& model, torch::optim::Optimizer* optimizer,
                        const TrainingProgress& progress) {
  wait();  // one save at a time, and their errors surface here
  const ShardLayout layout = model->shardLayout();
  const int rank = runtime_.rank();
  const int world = runtime_.worldSize();
  const std::string kind = optimizer != nullptr ? optimizerKind(*optimizer) : "";
  at::NoGradGuard noGrad;

  // What this rank writes: its shards (primary replica only), its RNG, rank 0's buffers.
  RankPlan plan;
  plan.rank = rank;
  json scalars = json::array();
  std::set<std::string> stateNames;
  for (std::size_t f = 0; f < layout.flats.size(); ++f) {
    const auto& flat = layout.flats[f];
    const std::int64_t valid =
        std::max<std::int64_t>(0, std::min(flat.shardNumel, flat.numel - flat.shardOffset));
    std::optional<OptimizerState> state;
    if (optimizer != nullptr) state = readState(*optimizer, kind, flat.shard);
    json flatScalars = json::object();
    if (state) {
      for (const auto& [name, value] : state->scalars) flatScalars[name] = value;
    }
    scalars.push_back(flatScalars);
    if (!layout.primaryReplica || valid == 0) continue;
    addBlock(plan, {.flat = static_cast<int>(f), .what = "param", .start = flat.shardOffset, .count = valid},
             flat.shard.detach().narrow(0, 0, valid), options_.async);
    if (state) {
      for (const auto& [name, tensor] : state->tensors) {
        stateNames.insert(name);
        addBlock(plan, {.flat = static_cast<int>(f), .what = "optim/" + name, .start = flat.shardOffset, .count = valid},
                 tensor.narrow(0, 0, valid), options_.async);
      }
    }
  }
  addBlock(plan, {.what = "rng/cpu"}, at::detail::getDefaultCPUGenerator().get_state(), options_.async);
  if (rank == 0) {
    for (const auto& item : model->module()->named_buffers()) {
      Block b{.what = "buffer/" + item.key()};
      b.shape = item.value().sizes().vec();
      addBlock(plan, b, item.value().detach(), options_.async);
    }
  }

  // Rank 0 also prepares the metadata that does not depend on the other ranks.
  json meta;
  if (rank == 0) {
    json flats = json::array();
    for (const auto& flat : layout.flats) {
      json params = json::array();
      for (const auto& p : flat.params) {
        params.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}, {"numel", p.numel}});
      }
      flats.push_back({{"unit", flat.unit},
                       {"numel", flat.numel},
                       {"dtype", dtypeName(flat.shard.scalar_type())},
                       {"requires_grad", flat.requiresGrad},
                       {"params", params}});
    }
    json groups = json::array();
    if (optimizer != nullptr) {
      for (const auto& g : optimizer->param_groups()) groups.push_back({{"lr", g.options().get_lr()}});
    }
    meta = {{"format", kFormat},
            {"format_version", kFormatVersion},
            {"library_version", kLibraryVersion},
            {"world_size", world},
            {"shard_size", layout.shardSize},
            {"strategy", toString(model->options().strategy)},
            {"step", progress.step},
            {"epoch", progress.position.epoch},
            {"step_in_epoch", progress.position.step},
            {"seed", progress.seed},
            {"extra", json::parse(progress.extraJson, nullptr, false)},
            {"flats", flats},
            {"optimizer", optimizer == nullptr ? json(nullptr)
                                               : json{{"kind", kind},
                                                      {"state", std::vector<std::string>(stateNames.begin(), stateNames.end())},
                                                      {"scalars", scalars},
                                                      {"param_groups", groups}}}};
    if (meta["extra"].is_discarded()) meta["extra"] = json::object();
  }

  const std::string dir = options_.dir;
  const std::string finalDir = dir + "/" + stepDirName(progress.step);
  const std::string tmp = dir + "/." + stepDirName(progress.step) + ".tmp.r" + std::to_string(runtime_.env().round);
  const std::string keyPrefix = runtime_.roundPrefix() + "ckpt/" + std::to_string(progress.step) + "/";
  auto& store = runtime_.store();
  const auto timeout = options_.timeout;
  const int keep = options_.keep;

  auto work = [plan = std::move(plan), meta = std::move(meta), dir, finalDir, tmp, keyPrefix, rank,
               world, timeout, keep, &store]() mutable {
    std::error_code ec;
    fs::create_directories(tmp, ec);
    if (ec) throw Error("checkpoint: cannot create " + tmp + ": " + ec.message());
    writeRankFile(tmp + "/" + rankFileName(rank), plan);
    // The block list travels through the store: rank 0 may not see the other ranks' disks'
    // caches yet, and it needs no extra file.
    store.set(keyPrefix + "files/" + std::to_string(rank), rankFileJson(plan).dump());
    if (rank != 0) {
      store.add(keyPrefix + "written", 1);
      return;
    }
    store.addAndWait(keyPrefix + "written", 1, world, timeout);
    json files = json::array();
    for (int r = 0; r < world; ++r) {
      json file = json::parse(store.get(keyPrefix + "files/" + std::to_string(r), timeout));
      file["file"] = rankFileName(r);
      files.push_back(std::move(file));
    }
    meta["files"] = std::move(files);
    writeFileDurably(tmp + "/metadata.json", meta.dump(1));
    commit(dir, tmp, finalDir, keep);
  };

  if (!options_.async) {
    work();
    return;
  }
  writer_ = std::thread([this, work = std::move(work)]() mutable {
    try {
      work();
    } catch (...) {
      writerError_ = std::current_exception();
    }
  });
}

std::optional<TrainingProgress> Checkpointer::loadLatest(FullyShardedDataParallel& model,
                                                         torch::optim::Optimizer* optimizer) {
  wait();
  // Rank 0 picks, everyone loads the same one (a directory listing may lag on shared disks).
  std::int64_t chosen = -1;
  if (runtime_.rank() == 0) {
    if (const auto newest = newestCheckpoint(options_.dir)) {
      chosen = std::stoll(fs::path(*newest).filename().string().substr(5));
    }
  }
  auto pick = at::full({1}, chosen, at::kLong);
  runtime_.cpuComm().broadcast(pick, 0).wait();
  chosen = pick.item<std::int64_t>();
  if (chosen < 0) return std::nullopt;
  const std::string path = options_.dir + "/" + stepDirName(chosen);

  // Everything is read and checked into new tensors first, and every rank learns whether every
  // other rank could: a bad file on one rank leaves the model as it was on all of them.
  const ShardLayout layout = model->shardLayout();
  std::string kind;
  std::vector<at::Tensor> shards;
  std::vector<std::optional<OptimizerState>> states;
  std::map<std::string, at::Tensor> buffers;
  std::optional<at::Tensor> rng;
  std::optional<Manifest> manifest;
  TrainingProgress progress;
  std::vector<double> groupLrs;
  std::string failure;
  at::NoGradGuard noGrad;
  try {
    manifest.emplace(readManifest(path));
    const Manifest& m = *manifest;
    checkModelFits(m, layout);
    progress.step = m.meta.at("step").get<std::int64_t>();
    progress.position = {m.meta.at("epoch").get<int>(), m.meta.at("step_in_epoch").get<std::int64_t>()};
    progress.seed = m.meta.at("seed").get<std::uint64_t>();
    progress.extraJson = m.meta.value("extra", json::object()).dump();
    if (m.meta.contains("optimizer") && m.meta["optimizer"].is_object() &&
        m.meta["optimizer"].contains("param_groups")) {
      for (const auto& group : m.meta["optimizer"]["param_groups"]) groupLrs.push_back(group.at("lr").get<double>());
    }
    if (optimizer != nullptr) {
      kind = optimizerKind(*optimizer);
      if (!m.optimizerKind.empty() && m.optimizerKind != kind) {
        throw ConfigError("checkpoint " + path + " holds " + m.optimizerKind +
                          " optimizer state, but the optimizer is " + kind);
      }
    }
    Reader reader(m);
    const auto stateNames = optimizer == nullptr ? std::vector<std::string>{} : optimizerStateNames(m);
    for (const auto& flat : layout.flats) {
      auto values = at::zeros_like(flat.shard.detach(), at::TensorOptions().device(at::kCPU));
      fillShard(reader, m, flat, "param", values);
      shards.push_back(values);
      OptimizerState st;
      for (const auto& name : stateNames) {
        auto t = at::zeros_like(values);
        fillShard(reader, m, flat, "optim/" + name, t);
        st.tensors[name] = t.to(flat.shard.device());
      }
      // Scalars (Adam's step) from the old flat parameter that held this one's first parameter.
      if (optimizer != nullptr && !flat.params.empty()) {
        const int oldFlat = m.params.at(flat.params.front().name).flat;
        if (static_cast<std::size_t>(oldFlat) < m.scalars.size()) st.scalars = m.scalars[static_cast<std::size_t>(oldFlat)];
      }
      if (!st.tensors.empty() || !st.scalars.empty()) {
        states.emplace_back(std::move(st));
      } else {
        states.emplace_back();
      }
    }
    buffers = readBuffers(reader, m);
    if (m.meta.at("world_size").get<int>() == runtime_.worldSize() && runtime_.rank() < m.files) {
      for (const auto& b : m.blocks[static_cast<std::size_t>(runtime_.rank())]) {
        if (b.what != "rng/cpu") continue;
        rng = reader.blockTensor(runtime_.rank(), b, {static_cast<std::int64_t>(b.bytes)}, at::kByte);
      }
    }
  } catch (const Error& e) {  // ConfigError, and I/O errors: either way the load is refused
    failure = e.what();
  } catch (const json::exception& e) {
    failure = "checkpoint " + path + "/metadata.json is malformed: " + e.what();
  }
  const std::string errorKey = runtime_.roundPrefix() + "ckpt/load/" + std::to_string(chosen) + "/error";
  if (!failure.empty()) runtime_.store().set(errorKey, failure);
  auto failed = at::full({1}, failure.empty() ? 0.0 : 1.0, at::kDouble);
  runtime_.cpuComm().allReduce(failed, ReduceOp::kMax).wait();
  if (failed.item<double>() > 0) {
    if (failure.empty()) failure = runtime_.store().get(errorKey);
    throw ConfigError(failure);
  }

  // All read and checked: now change the model, the optimizer, the RNG.
  for (std::size_t f = 0; f < layout.flats.size(); ++f) {
    layout.flats[f].shard.detach().copy_(shards[f]);
    if (optimizer != nullptr && states[f]) writeState(*optimizer, kind, layout.flats[f].shard, *states[f]);
  }
  for (const auto& item : model->module()->named_buffers()) {
    const auto it = buffers.find(item.key());
    if (it != buffers.end()) item.value().detach().copy_(it->second);
  }
  if (optimizer != nullptr) {
    auto& mine = optimizer->param_groups();
    for (std::size_t g = 0; g < std::min(groupLrs.size(), mine.size()); ++g) mine[g].options().set_lr(groupLrs[g]);
  }
  if (rng) {
    at::Generator generator = at::detail::getDefaultCPUGenerator();  // a handle to the default
    std::scoped_lock lock(generator.mutex());
    generator.set_state(*rng);
    progress.rngRestored = true;
  }
  runtime_.cpuComm().barrier().wait();
  return progress;
}

void saveFullCheckpoint(Runtime& runtime, FullyShardedDataParallel& model, const std::string& path) {
  c10::Dict<std::string, at::Tensor> dict;
  const bool writer = runtime.rank() == 0;
  model->visitFullParameters([&](const std::string& name, const at::Tensor& full) {
    if (writer) dict.insert(name, full.to(at::kCPU, full.scalar_type(), false, /*copy=*/true));
  });
  if (writer) {
    for (const auto& item : model->module()->named_buffers()) dict.insert(item.key(), item.value().to(at::kCPU, item.value().scalar_type(), false, /*copy=*/true));
    writePickle(dict, path);
  }
  runtime.cpuComm().barrier().wait();
}

// ---- offline tools ------------------------------------------------------------------------

std::optional<std::string> newestCheckpoint(const std::string& dir) {
  const auto complete = completeCheckpoints(dir);
  if (complete.empty()) return std::nullopt;
  return complete.back();
}

std::string inspectCheckpoint(const std::string& path) {
  const Manifest m = readManifest(path);
  Reader reader(m);
  std::uint64_t bytes = 0;
  std::int64_t elements = 0;
  for (int f = 0; f < m.files; ++f) {
    reader.file(f);  // size check
    for (const auto& b : m.blocks[static_cast<std::size_t>(f)]) {
      reader.blockTensor(f, b, {static_cast<std::int64_t>(b.bytes)}, at::kByte);  // CRC check
    }
    bytes += m.fileBytes[static_cast<std::size_t>(f)];
  }
  for (const auto& [name, p] : m.params) elements += p.numel;
  std::ostringstream out;
  out << "checkpoint " << path << ": complete, every block's CRC-32 checks\n"
      << "  step " << m.meta["step"] << ", epoch " << m.meta["epoch"] << ", step in epoch "
      << m.meta["step_in_epoch"] << ", seed " << m.meta["seed"] << "\n"
      << "  saved by " << m.meta["world_size"] << " rank(s), " << m.meta["strategy"].get<std::string>()
      << ", shard size " << m.meta["shard_size"] << ", library " << m.meta["library_version"].get<std::string>()
      << "\n"
      << "  " << m.params.size() << " parameters (" << elements << " elements) in "
      << m.flatNumel.size() << " flat parameters; optimizer "
      << (m.optimizerKind.empty() ? std::string("none") : m.optimizerKind) << "\n"
      << "  " << m.files << " rank file(s), " << bytes << " bytes\n";
  for (const auto& name : m.paramOrder) {
    const auto& p = m.params.at(name);
    out << "    " << name << " " << at::IntArrayRef(p.shape) << " "
        << m.flatDtype[static_cast<std::size_t>(p.flat)] << "\n";
  }
  return out.str();
}

void consolidateCheckpoint(const std::string& path, const std::string& outFile) {
  const Manifest m = readManifest(path);
  Reader reader(m);
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& name : m.paramOrder) {
    const auto& p = m.params.at(name);
    auto t = at::empty(p.shape, at::TensorOptions().dtype(parseDtype(m.flatDtype[static_cast<std::size_t>(p.flat)], path)));
    reader.paramRange(p, "param", 0, p.numel, static_cast<char*>(t.data_ptr()), t.element_size());
    dict.insert(name, t);
  }
  for (const auto& [name, tensor] : readBuffers(reader, m)) dict.insert(name, tensor);
  writePickle(dict, outFile);
}

void reshardCheckpoint(const std::string& path, const std::string& outDir, int world) {
  if (world < 1) throw ConfigError("--world " + std::to_string(world) + ": expected a positive number of ranks");
  const Manifest m = readManifest(path);
  Reader reader(m);
  if (fs::exists(outDir)) throw ConfigError("OUT '" + outDir + "' exists: refusing to overwrite it");
  const std::string tmp = outDir + ".tmp";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) throw Error("creating " + tmp + ": " + ec.message());
  std::vector<std::string> kinds{"param"};
  for (const auto& n : optimizerStateNames(m)) kinds.push_back("optim/" + n);
  json files = json::array();
  for (int r = 0; r < world; ++r) {
    RankPlan plan;
    plan.rank = r;
    for (std::size_t f = 0; f < m.flatNumel.size(); ++f) {
      const std::int64_t numel = m.flatNumel[f];
      const std::int64_t shard = (numel + world - 1) / world;
      const std::int64_t start = shard * r;
      const std::int64_t valid = std::max<std::int64_t>(0, std::min(shard, numel - start));
      if (valid == 0) continue;
      const auto dtype = parseDtype(m.flatDtype[f], path);
      for (const auto& what : kinds) {
        auto t = at::empty({valid}, at::TensorOptions().dtype(dtype));
        reader.flatRange(static_cast<int>(f), what, start, valid, static_cast<char*>(t.data_ptr()), t.element_size());
        addBlock(plan, {.flat = static_cast<int>(f), .what = what, .start = start, .count = valid}, t, false);
      }
    }
    if (r == 0) {
      for (const auto& b : m.blocks[0]) {
        if (!b.what.starts_with("buffer/")) continue;
        // Raw bytes: the block keeps its own dtype and shape.
        addBlock(plan, b, reader.blockTensor(0, b, {static_cast<std::int64_t>(b.bytes)}, at::kByte), false);
      }
    }
    writeRankFile(tmp + "/" + rankFileName(r), plan);
    json file = rankFileJson(plan);
    file["file"] = rankFileName(r);
    files.push_back(std::move(file));
  }
  json meta = m.meta;
  meta["world_size"] = world;
  meta["shard_size"] = world;
  meta["files"] = files;
  writeFileDurably(tmp + "/metadata.json", meta.dump(1));
  writeFileDurably(tmp + "/COMMIT", "complete\n");
  syncDirectory(tmp);
  fs::rename(tmp, outDir, ec);
  if (ec) throw Error("renaming " + tmp + " to " + outDir + ": " + ec.message());
}

}  // namespace fsdp::worker
