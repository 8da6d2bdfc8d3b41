// In-memory snapshots (snapshot.hpp): a rank's checkpoint plan written into a sealed memfd on a
// background thread, handed to the agent's keeper, copied to the next node's keeper. The
// restore (the agreement across nodes, the fetching) is snapshot_restore.cpp's.
#include "fsdp/worker/snapshot.hpp"

#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/sendfile.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <list>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include "checkpoint/checkpoint_internal.hpp"
#include "checkpoint/job_thread.hpp"
#include "comm/recorded_communicator.hpp"
#include "fsdp/worker/flight_recorder.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/common/snapshot_wire.hpp"
#include "fsdp/worker/runtime.hpp"
#include "reform/control.hpp"
#include "snapshot_fetch.hpp"
#include "snapshot_memory.hpp"
#include "snapshot_restore.hpp"

namespace fsdp::worker {

using namespace detail;
using snapshot::Fd;

namespace {

constexpr std::uint64_t alignUp(std::uint64_t n, std::uint64_t to) { return (n + to - 1) / to * to; }

// A piece's header: `base` (rank, world, step, round), the blocks and the rank's metadata,
// written out without copying the metadata (a large table of parameters for a big model).
std::string headerText(const json& base, json blocks, const json& meta) {
  json top = base;
  top["blocks"] = std::move(blocks);
  std::string text = top.dump();
  text.pop_back();  // the closing brace
  text += ",\"meta\":";
  text += meta.dump();
  text += '}';
  return text;
}

}  // namespace

struct Snapshotter::Impl {
  Runtime& runtime;
  SnapshotOptions options;
  bool enabled = false;
  Fd keeper;           // this node's keeper (Unix SOCK_SEQPACKET)
  std::string peerEndpoint;  // the next node's keeper, "" when none
  Fd peer;
  // The agent's abort notice (the world re-forms) ends a peer copy in flight: a node that stopped
  // answering (frozen, cut off) would hold this rank's re-formation, which waits for the snapshot
  // in flight, for up to the copy's timeout. Guards `peer` being set or closed, and
  // `peerAborted` (until rejoin()); the copy's I/O itself runs outside it.
  std::mutex peerMutex;
  bool peerAborted = false;
  int abortHook = -1;
  std::string token;
  std::atomic<bool> refused{false};
  // The metadata of the last snapshot: what does not change from step to step is built once
  // (refreshMeta updates the rest); `metaOf` names the layout it describes.
  json meta;
  std::vector<std::int64_t> metaOf;
  bool peerFailed = false;
  std::string restoredFrom;
  int restoreCalls = 0;
  SnapshotMemory memory;  // its buffers, the one the state lies in (snapshot_memory.hpp)
  // Writes and hands over one snapshot at a time. Last: it stops before what its jobs use goes.
  JobThread worker;

  Impl(Runtime& rt, SnapshotOptions o) : runtime(rt), options(o) {
    auto& control = ReformControl::process();
    if (control.active()) abortHook = control.addAbortHook([this](const std::string&) { abortPeerCopy(); });
  }
  ~Impl() {
    if (abortHook >= 0) ReformControl::process().removeAbortHook(abortHook);
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // From the control channel's thread: the peer copy in flight, if any, fails at once.
  void abortPeerCopy() {
    std::scoped_lock lock(peerMutex);
    peerAborted = true;
    if (peer) ::shutdown(peer.get(), SHUT_RDWR);
  }

  // Closes the peer connection; `clearAbort` (a new round): copies may start again. Returns
  // whether an abort notice had come.
  bool closePeer(bool clearAbort) {
    std::scoped_lock lock(peerMutex);
    peer.reset();
    return std::exchange(peerAborted, peerAborted && !clearAbort);
  }

  // Collective, at construction and at rejoin(): whether every rank has a keeper, and where the
  // next node's agent listens in this round.
  void agree() {
    const bool mine = keeper.get() >= 0;
    auto all = at::full({1}, mine ? 1.0 : 0.0, at::kDouble);
    const CommTag tag("snapshot", "agree");
    runtime.cpuComm().allReduce(all, ReduceOp::kMin).wait();
    enabled = all.item<double>() > 0;
    if (!enabled) {
      keeper.reset();
      return;
    }
    const auto& env = runtime.env();
    if (!env.tokenFile.empty()) {
      std::ifstream in(env.tokenFile);
      token.clear();
      std::getline(in, token);
    }
    peerEndpoint.clear();
    if (options.peerCopy && env.groupWorldSize > 1) {
      const std::string prefix = runtime.roundPrefix() + "snapshot/peer/";
      if (env.localRank == 0) {
        const char* mineEndpoint = std::getenv("FSDPRUN_SNAPSHOT_PEER");
        runtime.store().set(prefix + std::to_string(env.groupRank), mineEndpoint != nullptr ? mineEndpoint : "");
      }
      RankWait waiting({.group = "snapshot", .rank = runtime.rank(), .size = runtime.worldSize(),
                        .what = "start: waiting for the next node's agent"});
      peerEndpoint = runtime.store().get(prefix + std::to_string((env.groupRank + 1) % env.groupWorldSize),
                                         options.timeout);
      waiting.done();
    }
  }

  // Whether the shards and optimizer state lie in the snapshot of `step` this rank wrote (its
  // buffer, still what the keeper holds for that step). Else, whatever lies in snapshot memory
  // moves to memory of its own, uninitialised: a restore is about to write it.
  bool ownStateHolds(FullyShardedDataParallel& model, torch::optim::Optimizer* optimizer, std::int64_t step, int world) {
    auto& live = memory.live;
    if (!live || optimizer == nullptr) return false;
    const std::string kind = kindOf(*optimizer);
    if (kind.empty()) return false;
    const bool all = memory.liesInLive(model, *optimizer, kind);
    if (all && live->step == step && live->world == world && world == runtime.worldSize() &&
        live->rank == runtime.rank()) {
      return true;
    }
    at::NoGradGuard noGrad;
    forEachStateTensor(model, *optimizer, kind, [&](const at::Tensor&, const std::string&, at::Tensor& t) {
      if (inside(live, t)) t.set_(at::empty_like(t));
      return true;
    });
    live.reset();
    return false;
  }

  std::string pieceName(std::int64_t step) const {
    return "fsdprun-snapshot-r" + std::to_string(runtime.rank()) + "-s" + std::to_string(step);
  }

  json ask(const json& request, int fd = -1, Fd* passed = nullptr) {
    snapshot::sendMessage(keeper.get(), request.dump(), fd);
    auto answer = snapshot::receiveMessage(keeper.get());
    if (!answer) throw Error("this node's agent closed the snapshot socket");
    if (passed != nullptr) *passed = std::move(answer->second);
    return json::parse(answer->first);
  }

  // After a replacement's restore of step `recycleBefore` (-1: none, a process with memory of
  // its own, or the keeper had no more to spare), a snapshot that needs a buffer this process
  // does not have takes back instead the piece of its rank that the keeper drops at its next put
  // anyway (the oldest it holds, older than that step: the dead process's, never this one's):
  // memory whose pages exist already (mapping them again costs ~120 ms for DeepNet's 564 MB
  // here, a new buffer ~410 ms, on the training thread in step()).
  std::int64_t recycleBefore = -1;

  // The keeper's piece of this rank that its next put drops anyway, mapped writable as a free
  // buffer; null when it has none to spare (then recycleBefore stops the asking) or it cannot be
  // written (sealed). Best effort.
  std::shared_ptr<Buffer> takeBackDroppedPiece() {
    if (recycleBefore < 0) return nullptr;
    try {
      Fd fd;
      const json answer = ask({{"op", "recycle"}, {"rank", runtime.rank()}, {"world", runtime.worldSize()},
                               {"before", recycleBefore}}, -1, &fd);
      if (answer.value("ok", false) && fd) {
        if (auto b = memory.takeBack(std::move(fd))) return b;
      }
    } catch (const std::exception& e) {
      log::debug("rank {}: no snapshot memory taken back from the keeper: {}", runtime.rank(), e.what());
    }
    recycleBefore = -1;
    return nullptr;
  }

  // Maps a buffer's pages by reading a byte of each: a read fault on a memfd's existing pages maps
  // up to 16 of them (fault-around), writable on a shared mapping (shmem asks no notice of a
  // first write), so the writes that follow fault no more. 564 MB here: ~9k faults, 0.046 s,
  // where MADV_POPULATE_WRITE faults each page (0.105 s). MADV_POPULATE_READ costs the same
  // alone, but marks every page used under the LRU lock the other ranks' faults take: in a
  // replacement's first step (perf) it took twice the CPU time of this. No read falls past the
  // end: every piece is sealed against shrinking (the keeper takes no other), and a buffer of
  // this process is its own size.
  static void populate(const Buffer& b) {
    constexpr std::uint64_t kPage = 4096;
    const volatile char* p = b.map;
    char sink = 0;
    for (std::uint64_t at = 0; at < b.bytes; at += kPage) sink = static_cast<char>(sink ^ p[at]);
    static_cast<void>(sink);
  }

  // A replacement's restored piece, mapped copy-on-write, once no tensor lies in it (its first
  // step() moved the state out): unmapped, so that the keeper's copy, which it drops at one of
  // its next puts anyway, can come back as a buffer too instead of a new one (~140k zero-filled
  // pages for DeepNet, 0.6-0.8 s of a step here, against ~0.15 s to map existing ones).
  // (A restore that copied maps nothing: the piece can come back at once.)
  void releaseRestoredPiece() {
    if (recycleBefore < 0 || restoredPieceReleased) return;
    if (const auto piece = restoredPiece.lock()) {
      const auto listed = std::find(memory.buffers.begin(), memory.buffers.end(), piece);
      // Held by anything but this lock and the list (`live`, a tensor lying in it): not yet.
      if (piece.use_count() > 1 + (listed != memory.buffers.end() ? 1 : 0)) return;
      if (listed != memory.buffers.end()) memory.buffers.erase(listed);
    }
    restoredPieceReleased = true;
    ++recycleBefore;
  }
  bool restoredPieceReleased = false;
  std::weak_ptr<Buffer> restoredPiece;  // the piece the last restore mapped, while anything holds it

  // The size of the buffer step() asked for last (0: none since the last restore).
  std::uint64_t stepBytes = 0;

  // After a snapshot's put, on this thread: the buffer the next step() writes into, where none
  // is free (a new process's first steps), made or taken back while the next forward and
  // backward run rather than in that step's optimizer step. Best effort: step() asks again.
  void prepareNextBuffer() {
    {
      std::scoped_lock lock(peerMutex);
      if (peerAborted) return;  // the world re-forms: rejoin() waits for this thread
    }
    if (stepBytes == 0 || refused || memory.hasFree(stepBytes)) return;
    try {
      bufferFor(stepBytes, pieceName(-1));
    } catch (const std::exception& e) {
      log::debug("rank {}: no snapshot buffer made ahead: {}", runtime.rank(), e.what());
    }
  }

  // A buffer of `bytes` for the next snapshot: a free one, else one taken back from the keeper
  // (populated here), else a new one.
  std::shared_ptr<Buffer> bufferFor(std::uint64_t bytes, const std::string& name) {
    if (!memory.hasFree(bytes)) {
      releaseRestoredPiece();
      if (const auto b = takeBackDroppedPiece()) populate(*b);
    }
    return memory.bufferFor(bytes, name);
  }

  // Lays a zero-copy snapshot out in `buffer` when the plan's shards and optimizer state already
  // lie in it (step() put them there): their offsets are where they are, the small blocks go to
  // the region before them, the header into its reserve. False: the plan needs a copy.
  static bool layOutInPlace(Buffer& buffer, RankPlan& plan, const json& headerBase, const json& meta,
                            std::string& header) {
    if (buffer.headerReserve == 0) return false;
    const std::uint64_t dataOffset = snapshot::dataOffsetFor(buffer.headerReserve);
    const char* data = buffer.map + dataOffset;
    std::uint64_t small = 0;
    json blocks = json::array();
    for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
      auto& b = plan.blocks[i];
      const auto* p = static_cast<const char*>(plan.data[i].data_ptr());
      const bool big = b.what == "param" || b.what.starts_with("optim/");
      if (big) {
        if (p < data + buffer.smallBytes || p + b.bytes > buffer.map + buffer.bytes) return false;
        b.offset = static_cast<std::uint64_t>(p - data);
      } else {
        if (small + b.bytes > buffer.smallBytes) return false;
        b.offset = small;
        small = alignUp(small + b.bytes, 64);
      }
      blocks.push_back(blockJson(b));
    }
    header = headerText(headerBase, std::move(blocks), meta);
    if (header.size() > buffer.headerReserve) return false;
    header.resize(buffer.headerReserve, ' ');  // JSON allows the trailing spaces
    return true;
  }

  // The optimizer step written into a free buffer laid out as the next snapshot: the shards and
  // the optimizer state at fixed offsets after a region for the small blocks (RNG, the module's
  // buffers) and a reserve for the header. False, with nothing changed, when the model or the
  // optimizer does not allow it.
  bool stepIntoBuffer(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer) {
    stepBytes = 0;  // set again where this step writes into a buffer
    const std::string kind = kindOf(optimizer);
    if (kind.empty()) return false;
    if (kind != "adam" && kind != "adamw") return false;
    const ShardLayout layout = model->shardLayout();
    static const auto rngBytes = static_cast<std::uint64_t>(at::detail::getDefaultCPUGenerator().get_state().nbytes());
    std::uint64_t small = 4096 + rngBytes;
    std::uint64_t headerReserve = 65536;
    for (const auto& [name, buffer] : model->namedBuffers()) {
      small = alignUp(small + buffer.nbytes(), 64);
      headerReserve += 256 + name.size();
    }
    small = alignUp(small, 4096);
    std::map<const void*, std::map<std::string, std::uint64_t>> offsets;  // by TensorImpl, then what
    std::uint64_t cursor = small;
    const auto slot = [&](const at::Tensor& owner, const std::string& what, const at::Tensor& t) {
      offsets[owner.unsafeGetTensorImpl()][what] = cursor;
      cursor = alignUp(cursor + t.nbytes(), 64);
      headerReserve += 256;
    };
    for (const auto& flat : layout.flats) {
      // A shard that shares its memory (one rank: the full parameter itself) stays where it is.
      // One in a snapshot buffer is ours; what else refers to it only reads it (a checkpoint
      // writer's views of frozen state).
      if (!flat.shard.device().is_cpu() || !flat.shard.is_contiguous() ||
          (!inside(memory.live, flat.shard) && flat.shard.storage().use_count() != 1)) {
        return false;
      }
      slot(flat.shard, "param", flat.shard);
      if (const auto state = readState(optimizer, kind, flat.shard)) {
        for (const auto& [name, t] : state->tensors) {
          if (!t.is_contiguous() || t.numel() != flat.shard.numel()) return false;
          slot(flat.shard, name, t);
        }
      }
      headerReserve += 512;
      for (const auto& p : flat.params) headerReserve += 128 + p.name.size() + 24 * p.shape.size();
    }
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        if (!offsets.contains(p.unsafeGetTensorImpl())) return false;  // a parameter FSDP does not hold
      }
    }
    headerReserve = alignUp(headerReserve, 4096);
    const std::uint64_t dataOffset = snapshot::dataOffsetFor(headerReserve);
    const auto buffer = bufferFor(dataOffset + cursor, pieceName(-1));
    buffer->headerReserve = headerReserve;
    buffer->smallBytes = small;
    const auto place = [&](const at::Tensor& p, const char* what) {
      std::shared_ptr<Buffer> keep = buffer;  // the memory stays mapped while a tensor lies in it
      return at::from_blob(buffer->map + dataOffset + offsets.at(p.unsafeGetTensorImpl()).at(what), p.sizes(),
                           [keep](void*) mutable { keep.reset(); }, p.options().requires_grad(false));
    };
    if (!detail::stepInto(optimizer, place)) return false;  // (the first step makes Adam's state)
    stepBytes = buffer->bytes;
    // What the step did not write (frozen shards, shards without a gradient this step, their
    // state) is copied: the buffer holds the whole snapshot, and the last one is left alone.
    at::NoGradGuard noGrad;
    forEachStateTensor(model, optimizer, kind, [&](const at::Tensor& shard, const std::string& what, at::Tensor& t) {
      if (!inside(buffer, t)) t.set_(place(shard, what.c_str()).copy_(t));
      return true;
    });
    memory.live = buffer;
    return true;
  }

  // The background half of save(): write, seal, hand over, copy to the peer.
  // `meta` stays unchanged until the job is over (save() waits for it first).
  void write(RankPlan plan, const json& meta, std::int64_t step) {
    const int rank = runtime.rank();
    const int world = runtime.worldSize();
    const json headerBase = {{"rank", rank}, {"world", world}, {"step", step}, {"round", runtime.env().round}};
    std::string header;
    std::shared_ptr<Buffer> buffer;
    if (memory.live && layOutInPlace(*memory.live, plan, headerBase, meta, header)) {
      buffer = memory.live;
    } else {
      std::uint64_t offset = 0;
      json blocks = json::array();
      for (auto& b : plan.blocks) {
        b.offset = offset;
        offset += b.bytes;
        blocks.push_back(blockJson(b));
      }
      header = headerText(headerBase, std::move(blocks), meta);
      buffer = bufferFor(snapshot::dataOffsetFor(header.size()) + offset, pieceName(step));
    }
    const std::uint64_t dataOffset = snapshot::dataOffsetFor(header.size());
    const std::uint64_t total = buffer->bytes;
    buffer->step = step;
    buffer->rank = rank;
    buffer->world = world;
    snapshot::writePiecePrefix(buffer->map, header);
    for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
      char* to = buffer->map + dataOffset + plan.blocks[i].offset;
      if (to != plan.data[i].data_ptr()) std::memcpy(to, plan.data[i].data_ptr(), plan.blocks[i].bytes);
    }
    plan.data.clear();  // the views of the live tensors go before the training thread goes on
    const int piece = buffer->fd.get();
    const json answer = ask({{"op", "put"}, {"rank", rank}, {"world", world}, {"step", step}, {"round", runtime.env().round}},
                            piece);
    if (!answer.value("ok", false)) {
      refused = true;
      memory.buffers.clear();
      buffer.reset();
      log::warn("rank {}: in-memory snapshots are off for this run: {}; disk checkpoints go on", rank,
                answer.value("error", std::string("refused")));
      return;
    }
    // What the keeper no longer holds is this process's to overwrite. It holds one piece of a
    // rank per step, so another buffer of this step (a step redone after a resume from further
    // back: a survivor that had put it before the failure) is free too, unless the keeper still
    // sends it to a peer (then `held` names the step twice). Else the survivor made a new buffer
    // in its first steps after such a resume (564 MB zero-filled for DeepNet, 60+ ms of a core).
    const auto held = answer.value("held", std::vector<std::int64_t>{});
    const bool stepHeldTwice = std::count(held.begin(), held.end(), step) > 1;
    for (auto& b : memory.buffers) {
      if (b == buffer) continue;
      const bool otherOfThisStep = b->step == step && !stepHeldTwice;
      if (otherOfThisStep || std::find(held.begin(), held.end(), b->step) == held.end()) b->step = -1;
    }
    if (peerEndpoint.empty() || peerFailed) return;
    try {
      if (!peer) {
        {
          std::scoped_lock lock(peerMutex);
          if (peerAborted) throw Error("the world re-forms");  // no new connection for this round
        }
        // Not cut short while it connects (a host that drops packets: up to options.timeout); a
        // frozen process's kernel still accepts the connection.
        Fd connected = connectKeeper(peerEndpoint, options.timeout);
        std::scoped_lock lock(peerMutex);
        peer = std::move(connected);
        if (peerAborted) ::shutdown(peer.get(), SHUT_RDWR);
      }
      const std::string frame =
          json{{"run", runtime.env().runId}, {"rank", rank}, {"world", world}, {"step", step}, {"bytes", total},
               {"mac", snapshot::peerMac(token, runtime.env().runId, rank, world, step, total)}}
              .dump();
      snapshot::writeFrame(peer.get(), frame);
      off_t from = 0;
      while (static_cast<std::uint64_t>(from) < total) {
        const ssize_t n = ::sendfile(peer.get(), piece, &from, total - static_cast<std::uint64_t>(from));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) throwErrno("sending a snapshot to " + peerEndpoint, errno);
      }
      const auto reply = snapshot::readFrame(peer.get(), "the peer keeper at " + peerEndpoint);
      if (!reply) throw Error("the peer keeper at " + peerEndpoint + " closed the stream");
      const json r = json::parse(*reply, nullptr, false);
      if (!r.is_object() || !r.value("ok", false)) {
        throw Error(r.is_object() ? r.value("error", std::string("refused")) : std::string("a malformed reply"));
      }
    } catch (const std::exception& e) {
      peerFailed = true;
      if (closePeer(/*clearAbort=*/false)) {
        log::info("rank {}: the peer copy of step {} was cut short: the world re-forms", rank, step);
      } else {
        log::warn("rank {}: no peer copies of snapshots from now on ({}): a lost node resumes from disk", rank,
                  e.what());
      }
    }
  }
};

Snapshotter::Snapshotter(Runtime& runtime, SnapshotOptions options)
    : impl_(std::make_unique<Impl>(runtime, options)) {
  auto& d = *impl_;
  const char* socket = std::getenv("FSDPRUN_SNAPSHOT_SOCKET");
  if (socket != nullptr && *socket != '\0') {
    try {
      d.keeper = Fd(snapshot::connectSeqpacket(socket));
      setSocketTimeouts(d.keeper.get(), options.timeout);
    } catch (const Error& e) {
      log::warn("rank {}: no in-memory snapshots: {}", runtime.rank(), e.what());
    }
  }
  d.agree();
}

void Snapshotter::rejoin() {
  auto& d = *impl_;
  wait();
  d.stepBytes = 0;  // the new round's layout may differ
  d.closePeer(/*clearAbort=*/true);
  d.peerFailed = false;
  d.restoreCalls = 0;  // the restore's store keys, per round and call: as a new process counts
  d.agree();
}

Snapshotter::~Snapshotter() {
  try {
    wait();
  } catch (const std::exception& e) {
    log::warn("an in-memory snapshot failed: {}", e.what());
  }
}

bool Snapshotter::enabled() const { return impl_->enabled && !impl_->refused; }

const std::string& Snapshotter::restoredFrom() const { return impl_->restoredFrom; }

void Snapshotter::wait() {
  impl_->worker.wait();
}

void Snapshotter::step(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer) {
  auto& d = *impl_;
  wait();
  if (enabled() && d.stepIntoBuffer(model, optimizer)) return;
  d.memory.moveOut(model, optimizer);
  optimizer.step();
}

bool Snapshotter::frozen(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer) const {
  const auto& d = *impl_;
  if (!d.memory.live) return false;
  const std::string kind = kindOf(optimizer);
  if (kind.empty()) return false;
  return d.memory.liesInLive(model, optimizer, kind);
}

void Snapshotter::save(FullyShardedDataParallel& model, torch::optim::Optimizer* optimizer,
                       const TrainingProgress& progress) {
  auto& d = *impl_;
  markProgress(progress.step, "snapshot step");
  wait();
  if (!enabled()) return;
  // Buffers change in the next forward: copied now (they are small); shards and optimizer state
  // only change at the next optimizer step, after wait().
  const ShardLayout layout = model->shardLayout();
  std::vector<std::int64_t> layoutKey{d.runtime.worldSize(), layout.shardSize};
  for (const auto& flat : layout.flats) layoutKey.push_back(flat.numel);
  const bool sameLayout = layoutKey == d.metaOf;
  auto state = describeRank(model, optimizer, progress, d.runtime.rank(), d.runtime.worldSize(), /*copy=*/false,
                            /*buffers=*/false, /*withMeta=*/!sameLayout, /*everyReplica=*/true);
  if (sameLayout) {
    refreshMeta(d.meta, layout, optimizer, progress);
  } else {
    d.meta = std::move(state.meta);
    d.metaOf = std::move(layoutKey);
  }
  d.meta["primary_replica"] = layout.primaryReplica;
  addBuffers(state.plan, model, /*copy=*/true);
  d.worker.run([&d, plan = std::move(state.plan), step = progress.step]() mutable {
    try {
      d.write(std::move(plan), d.meta, step);
      d.prepareNextBuffer();
    } catch (const std::exception& e) {
      d.refused = true;
      log::warn("rank {}: an in-memory snapshot of step {} failed ({}); snapshots are off for this run", d.runtime.rank(),
                step, e.what());
    }
  });
}

std::optional<TrainingProgress> Snapshotter::restore(FullyShardedDataParallel& model,
                                                     torch::optim::Optimizer* optimizer) {
  auto& d = *impl_;
  // The start of the job's own work: fsdprun's watchdog judges by the hang timeout from here on.
  markProgress(-1, "snapshot restore");
  wait();
  d.stepBytes = 0;  // the layout may change
  if (!d.enabled) return std::nullopt;
  const KeeperLink link{.runtime = d.runtime,
                        .ask = [&d](const json& request, Fd* passed) { return d.ask(request, -1, passed); },
                        .token = d.token,
                        .timeout = d.options.timeout,
                        .call = d.restoreCalls++,
                        .ownStateHolds = [&d, &model, optimizer](std::int64_t step, int world) {
                          return d.ownStateHolds(model, optimizer, step, world);
                        },
                        .mapOwnPiece = [&d](int fd, std::uint64_t bytes, std::int64_t step, int world) {
                          return d.memory.mapPiece(fd, bytes, step, d.runtime.rank(), world);
                        }};
  std::optional<detail::Restored> restored;
  try {
    restored = restoreFromKeepers(link, model, optimizer);
  } catch (...) {
    d.memory.mapped.reset();
    throw;
  }
  d.restoredPiece = d.memory.mapped;  // kept or not, tensors may lie in it
  std::shared_ptr<Buffer> mappedState;
  if (d.memory.keepMapped(model, optimizer)) {
    log::debug("rank {}: the state of step {} lies in its piece, mapped (not copied)", d.runtime.rank(),
               d.memory.live->step);
    mappedState = d.memory.live;
  }
  if (!restored) return std::nullopt;
  // A process without snapshot memory of its own (a replacement) takes the first piece back now
  // and makes its pages writable on the snapshot thread while the first step's forward and
  // backward run (step() waits for it); its next snapshots take theirs back as they need them.
  // Never a process with memory of its own: the keeper's pieces before `step` are its own
  // buffers, which a second mapping would let two snapshots write at once.
  d.recycleBefore = d.memory.ownsMemory() ? -1 : restored->progress.step;
  d.restoredPieceReleased = false;
  // The piece the state lies in first: its pages mapped for reading in a few calls, not one
  // fault each in the first step's gather and optimizer step (DeepNet, ~140k pages: the
  // replacement's first optimizer step ~35 ms longer than the survivor's, ~15 ms with this).
  const auto back = d.takeBackDroppedPiece();
  if (mappedState || back) {
    d.worker.run([mappedState, back] {
      // On a thread of its own at the lowest priority (nice 19): the pages are made with the CPU
      // time the ranks' first step leaves, not a core's time taken from its forward (2 cores, 2
      // ranks: the replacement's first batch came 80-100 ms late, its forward 50-140 ms slower);
      // step() waits for this job, and then the core is its own. Never starved for good, as
      // the idle class could be on a busy machine. A job throws nothing (JobThread): where no
      // thread can be made, the pages are made here, at this thread's priority.
      const auto populateAll = [&] {
        if (mappedState) Impl::populate(*mappedState);
        if (back) Impl::populate(*back);
      };
      try {
        std::thread low([&] {
          ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
          populateAll();
        });
        low.join();
      } catch (const std::system_error&) {
        populateAll();
      }
    });
  }
  d.restoredFrom = std::move(restored->source);
  return std::move(restored->progress);
}

}  // namespace fsdp::worker
