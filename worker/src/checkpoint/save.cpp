// The Checkpointer's lifecycle and save: each rank writes its shards, RNG state (rank 0 also
// buffers and metadata), synchronously or on its writer thread, then rank 0 commits.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <thread>

#include "checkpoint_internal.hpp"
#include "comm/recorded_communicator.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/worker/runtime.hpp"

namespace fsdp::worker {

using namespace detail;

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

namespace detail {
namespace {

// Test hook: FSDPRUN_TEST_CHECKPOINT_WRITE_DELAY=RANK:MS makes that rank's first checkpoint write
// of the process take MS longer (a slow disk on one node), inside its LongOperation.
void testWriteDelay(int rank) {
  static std::atomic<bool> done{false};
  const char* text = std::getenv("FSDPRUN_TEST_CHECKPOINT_WRITE_DELAY");
  if (text == nullptr || done.exchange(true)) return;
  int who = -1;
  long long ms = 0;
  if (std::sscanf(text, "%d:%lld", &who, &ms) != 2 || who != rank || ms <= 0) return;
  log::warn("test hook FSDPRUN_TEST_CHECKPOINT_WRITE_DELAY: rank {} sleeps {} ms inside its checkpoint write", rank, ms);
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

// Rank 0's wait until every rank has written its file: adds its own count to `key`, then waits
// for `world`. On the runtime's store, whose waits end with CommAborted on the agent's abort
// notice (--restart_mode auto): a rank lost before it wrote would otherwise hold this one, and
// with it the re-formation, for the whole save timeout.
void awaitRankFiles(rendezvous::StoreClient& store, const std::string& key, int world,
                    std::chrono::milliseconds timeout) {
  try {
    store.addAndWait(key, 1, world, timeout);
  } catch (const TimeoutError&) {
    throw TimeoutError("checkpoint save: not every rank's file was written after " + std::to_string(timeout.count()) +
                       " ms (store counter [" + key + "] short of " + std::to_string(world) + ")");
  }
}

}  // namespace

void addBuffers(RankPlan& plan, FullyShardedDataParallel& model, bool copy) {
  for (const auto& [name, buffer] : model->namedBuffers()) {
    Block b{.what = "buffer/" + name};
    b.shape = buffer.sizes().vec();
    addBlock(plan, b, buffer.detach(), copy);
  }
}

RankState describeRank(FullyShardedDataParallel& model, torch::optim::Optimizer* optimizer,
                       const TrainingProgress& progress, int rank, int world, bool copy, bool buffers,
                       bool withMeta, bool everyReplica) {
  const ShardLayout layout = model->shardLayout();
  const std::string kind = optimizer != nullptr ? optimizerKind(*optimizer) : "";
  at::NoGradGuard noGrad;

  // What this rank writes: its shards (primary replica only), its RNG, the buffers if asked.
  RankState out;
  RankPlan& plan = out.plan;
  plan.rank = rank;
  for (std::size_t f = 0; f < layout.flats.size(); ++f) {
    const auto& flat = layout.flats[f];
    const std::int64_t valid =
        std::max<std::int64_t>(0, std::min(flat.shardNumel, flat.numel - flat.shardOffset));
    if ((!layout.primaryReplica && !everyReplica) || valid == 0) continue;
    std::optional<OptimizerState> state;
    if (optimizer != nullptr) state = readState(*optimizer, kind, flat.shard);
    addBlock(plan, {.flat = static_cast<int>(f), .what = "param", .start = flat.shardOffset, .count = valid},
             flat.shard.detach().narrow(0, 0, valid), copy);
    if (state) {
      for (const auto& [name, tensor] : state->tensors) {
        addBlock(plan, {.flat = static_cast<int>(f), .what = "optim/" + name, .start = flat.shardOffset, .count = valid},
                 tensor.narrow(0, 0, valid), copy);
      }
    }
  }
  // The generator's state is a new tensor already: never a view of something that changes.
  addBlock(plan, {.what = "rng/cpu"}, at::detail::getDefaultCPUGenerator().get_state(), false);
  if (buffers) addBuffers(plan, model, copy);
  if (!withMeta) return out;

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
  out.meta = {{"format", kFormat},
              {"format_version", kFormatVersion},
              {"library_version", kLibraryVersion},
              {"world_size", world},
              {"shard_size", layout.shardSize},
              {"strategy", toString(model->options().strategy)},
              {"buffer_names", "original"},  // namedBuffers()'s, not the wrapped module's paths
              {"flats", std::move(flats)}};
  refreshMeta(out.meta, layout, optimizer, progress);
  return out;
}

void refreshMeta(json& meta, const ShardLayout& layout, torch::optim::Optimizer* optimizer,
                 const TrainingProgress& progress) {
  meta["step"] = progress.step;
  meta["epoch"] = progress.position.epoch;
  meta["step_in_epoch"] = progress.position.step;
  meta["seed"] = progress.seed;
  meta["extra"] = json::parse(progress.extraJson, nullptr, false);
  if (meta["extra"].is_discarded()) meta["extra"] = json::object();
  if (optimizer == nullptr) {
    meta["optimizer"] = nullptr;
    return;
  }
  const std::string kind = optimizerKind(*optimizer);
  json scalars = json::array();
  std::set<std::string> stateNames;
  for (const auto& flat : layout.flats) {
    json flatScalars = json::object();
    if (const auto state = readState(*optimizer, kind, flat.shard)) {
      for (const auto& [name, value] : state->scalars) flatScalars[name] = value;
      for (const auto& item : state->tensors) stateNames.insert(item.first);
    }
    scalars.push_back(std::move(flatScalars));
  }
  json groups = json::array();
  for (const auto& g : optimizer->param_groups()) groups.push_back({{"lr", g.options().get_lr()}});
  meta["optimizer"] = {{"kind", kind},
                       {"state", std::vector<std::string>(stateNames.begin(), stateNames.end())},
                       {"scalars", std::move(scalars)},
                       {"param_groups", std::move(groups)}};
}

}  // namespace detail

void Checkpointer::save(FullyShardedDataParallel& model, torch::optim::Optimizer* optimizer,
                        const TrainingProgress& progress, bool frozen) {
  const int rank = runtime_.rank();
  const int world = runtime_.worldSize();
  RankPlan plan;
  json meta;
  {
    // This rank's own work (the previous save's write, the copies) is busy, not stalled. The wait
    // for the other ranks below is not: it is recorded like a collective (fsdprun's watchdog).
    const LongOperation busy("checkpoint copy");
    wait();  // one save at a time, and their errors surface here
    // Frozen shards and optimizer state (an in-memory snapshot's) are written from where they
    // are; the buffers change in the next forward, so an asynchronous save copies them still.
    auto described = describeRank(model, optimizer, progress, rank, world, options_.async && !frozen,
                                  /*buffers=*/false, /*withMeta=*/rank == 0);
    plan = std::move(described.plan);
    meta = std::move(described.meta);
    if (rank == 0) addBuffers(plan, model, options_.async);
  }

  const std::string dir = options_.dir;
  const std::string finalDir = dir + "/" + stepDirName(progress.step);
  const std::string tmp = dir + "/." + stepDirName(progress.step) + ".tmp.r" + std::to_string(runtime_.env().round);
  const std::string keyPrefix = runtime_.roundPrefix() + "ckpt/" + std::to_string(progress.step) + "/";
  auto& store = runtime_.store();
  const auto timeout = options_.timeout;
  const int keep = options_.keep;
  const std::int64_t step = progress.step;
  const bool ownThread = options_.async;

  auto work = [plan = std::move(plan), meta = std::move(meta), dir, finalDir, tmp, keyPrefix, rank,
               world, timeout, keep, step, ownThread, &store]() mutable {
    // On the writer thread the training thread marks progress meanwhile: nothing to say.
    std::optional<LongOperation> busy;
    if (!ownThread) busy.emplace("checkpoint write");
    std::error_code ec;
    fs::create_directories(tmp, ec);
    if (ec) throw Error("checkpoint: cannot create " + tmp + ": " + ec.message());
    detail::testWriteDelay(rank);
    writeRankFile(tmp + "/" + rankFileName(rank), plan);
    busy.reset();
    // The block list travels through the store: rank 0 may not see the other ranks' disks'
    // caches yet, and it needs no extra file.
    store.set(keyPrefix + "files/" + std::to_string(rank), rankFileJson(plan).dump());
    const std::string what = "save step " + std::to_string(step) + ": waiting for ranks' files";
    const RankWait::Point point{.group = "checkpoint", .rank = rank, .size = world, .step = step, .what = what};
    if (rank != 0) {
      RankWait arrived(point, /*waits=*/false);
      store.add(keyPrefix + "written", 1);
      return;
    }
    json files = json::array();
    {
      RankWait waiting(point);
      detail::awaitRankFiles(store, keyPrefix + "written", world, timeout);
      for (int r = 0; r < world; ++r) {
        json file = json::parse(store.get(keyPrefix + "files/" + std::to_string(r), timeout));
        file["file"] = rankFileName(r);
        files.push_back(std::move(file));
      }
      waiting.done();
    }
    if (!ownThread) busy.emplace("checkpoint commit");
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

}  // namespace fsdp::worker
