// Loading the newest checkpoint: checking it fits the model, resharding saved flat parameters
// onto this world's shard layout, optimizer state, buffers and the CPU RNG state.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <set>
#include <sstream>

#include "checkpoint_internal.hpp"
#include "comm/recorded_communicator.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/worker/flight_recorder.hpp"
#include "fsdp/worker/runtime.hpp"

namespace fsdp::worker {

using namespace detail;

namespace {

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

// Each buffer of the model with its saved value. Checkpoints name them as namedBuffers() does
// ("buffer_names": "original" in their metadata), and the load is strict as PyTorch's
// load_state_dict: every buffer of the model is there, of its shape, and nothing else is. Older
// checkpoints named them by the module's own paths, which auto-wrap's units lengthen
// ("fc2.module.mask"): read as before, by this model's paths (else the original name), a missing
// one left as it is (`warn`: said so).
std::vector<std::pair<at::Tensor, at::Tensor>> matchBuffers(const Manifest& m, FullyShardedDataParallel& model,
                                                            const std::map<std::string, at::Tensor>& saved, bool warn) {
  const bool original = m.meta.value("buffer_names", std::string()) == "original";
  const auto& mine = model->namedBuffers();
  std::map<const c10::TensorImpl*, std::vector<std::string>> paths;  // the wrapped module's, by tensor
  if (!original) {
    for (const auto& item : model->module()->named_buffers()) {
      paths[item.value().unsafeGetTensorImpl()].push_back(item.key());
    }
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> matched;
  std::string missing;
  for (const auto& [name, buffer] : mine) {
    auto it = saved.find(name);
    if (const auto own = paths.find(buffer.unsafeGetTensorImpl()); own != paths.end()) {
      for (const auto& path : own->second) {
        if (const auto byPath = saved.find(path); byPath != saved.end()) it = byPath;
      }
    }
    if (it == saved.end()) {
      if (original) {
        throw ConfigError("checkpoint " + m.path + " does not fit this model: it has no buffer '" + name +
                          "' (wrong model?)");
      }
      missing += (missing.empty() ? "'" : ", '") + name + "'";
      continue;
    }
    if (it->second.sizes() != buffer.sizes()) {
      std::ostringstream text;
      text << "checkpoint " << m.path << " does not fit this model: buffer '" << name << "' has shape "
           << it->second.sizes() << " there but " << buffer.sizes() << " here";
      throw ConfigError(text.str());
    }
    matched.emplace_back(buffer, it->second);
  }
  if (original && matched.size() != saved.size()) {
    std::set<std::string> names;
    for (const auto& item : mine) names.insert(item.first);
    for (const auto& item : saved) {
      if (!names.contains(item.first)) {
        throw ConfigError("checkpoint " + m.path + " does not fit this model: the model has no buffer '" +
                          item.first + "' (wrong model?)");
      }
    }
  }
  if (!missing.empty() && warn) {
    log::warn("checkpoint {} (saved before buffers kept their module's names) has no buffer {}: left as they are",
              m.path, missing);
  }
  return matched;
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

}  // namespace

std::optional<TrainingProgress> Checkpointer::loadLatest(FullyShardedDataParallel& model,
                                                         torch::optim::Optimizer* optimizer) {
  // The start of the job's own work: fsdprun's watchdog judges by the hang timeout from here on.
  markProgress(-1, "checkpoint load");
  // Rank 0 picks, everyone loads the same one (a directory listing may lag on shared disks).
  std::int64_t chosen = -1;
  {
    // Reading is this rank's own work, busy, not stalled; the collectives below wait for the others.
    const LongOperation busy("checkpoint read");
    wait();
    if (runtime_.rank() == 0) {
      if (const auto newest = newestCheckpoint(options_.dir)) {
        chosen = std::stoll(fs::path(*newest).filename().string().substr(5));
      }
    }
  }
  auto pick = at::full({1}, chosen, at::kLong);
  const CommTag tag("checkpoint", "pick");
  runtime_.cpuComm().broadcast(pick, 0).wait();
  chosen = pick.item<std::int64_t>();
  if (chosen < 0) return std::nullopt;

  const std::string path = options_.dir + "/" + stepDirName(chosen);
  const std::string errorKey = runtime_.roundPrefix() + "ckpt/load/" + std::to_string(chosen) + "/error";
  std::optional<Manifest> manifest;
  std::string failure;
  try {
    const LongOperation busy("checkpoint read");
    manifest.emplace(readManifest(path));
  } catch (const Error& e) {
    failure = e.what();
  }
  if (!manifest) {
    // The others may have read it: they wait in loadManifest's agreement, which this joins.
    manifest.emplace();
    manifest->path = path;
  }
  Reader reader(*manifest);
  return loadManifest(runtime_, *manifest, reader, model, optimizer, errorKey, failure);
}

namespace detail {

TrainingProgress loadManifest(Runtime& runtime, const Manifest& m, Reader& reader, FullyShardedDataParallel& model,
                              torch::optim::Optimizer* optimizer, const std::string& errorKey,
                              std::string failure, bool keepOwnState) {
  const std::string& path = m.path;
  // Everything is read and checked into new tensors first, and every rank learns whether every
  // other rank could: a bad file on one rank leaves the model as it was on all of them.
  const ShardLayout layout = model->shardLayout();
  std::string kind;
  std::vector<at::Tensor> shards;
  std::vector<bool> viewed;  // per shard: a view of the mapped file, to be taken as it is
  std::vector<std::optional<OptimizerState>> states;
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers;  // the model's, its saved value
  std::optional<at::Tensor> rng;
  TrainingProgress progress;
  std::vector<double> groupLrs;
  at::NoGradGuard noGrad;
  if (failure.empty()) try {
    const LongOperation busy("checkpoint read");
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
    const auto stateNames = optimizer == nullptr ? std::vector<std::string>{} : optimizerStateNames(m);
    // Whether old flat parameter `oldFlat` had optimizer state `what` saved: a frozen one (a
    // LoRA base, a frozen unit) never had any, and gets none.
    const auto saved = [&m](int oldFlat, const std::string& what) {
      for (const auto& file : m.blocks) {
        for (const auto& b : file) {
          if (b.flat == oldFlat && b.what == what) return true;
        }
      }
      return false;
    };
    // This rank's own file at this very layout, mapped (a snapshot's piece): its shards and
    // optimizer state are used where they lie, not read (Reader::view says where it cannot).
    const int rank = runtime.rank();
    const bool ownFile = m.meta.at("world_size").get<int>() == runtime.worldSize() && rank < m.files;
    const auto sameFlat = [&](std::size_t f, const FlatParamInfo& flat) {
      if (!ownFile || f >= m.flatNumel.size() || m.flatNumel[f] != flat.numel) return false;
      return std::all_of(flat.params.begin(), flat.params.end(), [&](const auto& p) {
        const auto& saved = m.params.at(p.name);
        return saved.flat == static_cast<int>(f) && saved.offset == p.offset;
      });
    };
    // Once sameFlat(f) holds.
    const auto inPlace = [&](std::size_t f, const FlatParamInfo& flat, const std::string& what) {
      const std::int64_t valid = std::max<std::int64_t>(0, std::min(flat.shardNumel, flat.numel - flat.shardOffset));
      for (const auto& b : m.blocks[static_cast<std::size_t>(rank)]) {
        if (b.flat == static_cast<int>(f) && b.what == what && b.start == flat.shardOffset && b.count == valid) {
          return reader.view(rank, b, flat.shard);
        }
      }
      return at::Tensor();
    };
    for (std::size_t f = 0; f < layout.flats.size(); ++f) {
      if (keepOwnState) break;  // this rank's own state holds the step already
      const auto& flat = layout.flats[f];
      const bool mapped = sameFlat(f, flat);
      // The shard takes the view's memory by set_(): only where nothing else refers to its own
      // (one rank: the module's parameters are views of it).
      auto values = mapped && flat.shard.storage().use_count() == 1 ? inPlace(f, flat, "param") : at::Tensor();
      viewed.push_back(values.defined());
      if (!viewed.back()) {
        values = at::zeros_like(flat.shard.detach(), at::TensorOptions().device(at::kCPU));
        fillShard(reader, m, flat, "param", values);
      }
      shards.push_back(values);
      OptimizerState st;
      const int oldFlat = flat.params.empty() ? -1 : m.params.at(flat.params.front().name).flat;
      for (const auto& name : stateNames) {
        if (oldFlat >= 0 && !saved(oldFlat, "optim/" + name)) continue;
        auto t = mapped ? inPlace(f, flat, "optim/" + name) : at::Tensor();
        if (!t.defined()) {
          t = at::zeros_like(flat.shard.detach(), at::TensorOptions().device(at::kCPU));
          fillShard(reader, m, flat, "optim/" + name, t);
        }
        st.tensors[name] = t.to(flat.shard.device());
      }
      // Scalars (Adam's step) from the old flat parameter that held this one's first parameter.
      if (optimizer != nullptr && oldFlat >= 0) {
        if (static_cast<std::size_t>(oldFlat) < m.scalars.size()) st.scalars = m.scalars[static_cast<std::size_t>(oldFlat)];
      }
      if (!st.tensors.empty() || !st.scalars.empty()) {
        states.emplace_back(std::move(st));
      } else {
        states.emplace_back();
      }
    }
    buffers = matchBuffers(m, model, readBuffers(reader, m), runtime.rank() == 0);
    if (ownFile) {
      for (const auto& b : m.blocks[static_cast<std::size_t>(runtime.rank())]) {
        if (b.what != "rng/cpu") continue;
        rng = reader.blockTensor(runtime.rank(), b, {static_cast<std::int64_t>(b.bytes)}, at::kByte);
      }
    }
  } catch (const Error& e) {  // ConfigError, and I/O errors: either way the load is refused
    failure = e.what();
  } catch (const json::exception& e) {
    failure = "checkpoint " + path + "/metadata.json is malformed: " + e.what();
  }
  if (!failure.empty()) runtime.store().set(errorKey, failure);
  auto failed = at::full({1}, failure.empty() ? 0.0 : 1.0, at::kDouble);
  // A snapshot restore names its collectives itself.
  std::optional<CommTag> tag;
  if (*detail::currentCommTag() == '\0') tag.emplace("checkpoint", "load");
  runtime.cpuComm().allReduce(failed, ReduceOp::kMax).wait();
  if (failed.item<double>() > 0) {
    if (failure.empty()) failure = runtime.store().get(errorKey);
    throw ConfigError(failure);
  }

  // All read and checked: now change the model, the optimizer, the RNG.
  for (std::size_t f = 0; f < shards.size(); ++f) {
    if (viewed[f]) {
      layout.flats[f].shard.set_(shards[f]);  // every holder (the optimizer, FSDP) sees it
    } else {
      layout.flats[f].shard.detach().copy_(shards[f]);
    }
    if (optimizer != nullptr && states[f]) writeState(*optimizer, kind, layout.flats[f].shard, *states[f]);
  }
  for (const auto& [buffer, saved] : buffers) buffer.detach().copy_(saved);
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
  runtime.cpuComm().barrier().wait();
  return progress;
}

}  // namespace detail

}  // namespace fsdp::worker
