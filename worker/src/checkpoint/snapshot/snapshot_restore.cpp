// The restore of in-memory snapshots (snapshot_restore.hpp): every node's holdings published in
// the store, one decision every rank makes alike from them, and the fetch of the pieces this
// rank needs, from its own node's keeper or from another's over TCP.
#include "snapshot_restore.hpp"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>

#include "checkpoint/checkpoint_internal.hpp"
#include "comm/recorded_communicator.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/worker/runtime.hpp"
#include "snapshot_fetch.hpp"

namespace fsdp::worker::detail {

using snapshot::Fd;

std::string holdingsText(const NodeHoldings& holdings) {
  json pieces = json::array();
  for (const auto& p : holdings.pieces)
    pieces.push_back(json::array({p.rank, p.world, p.step, p.peer, p.round}));
  return json{{"endpoint", holdings.endpoint}, {"pieces", std::move(pieces)}}.dump();
}

NodeHoldings parseHoldings(const std::string& text) {
  NodeHoldings holdings;
  const json j = json::parse(text, nullptr, false);
  if (!j.is_object()) return holdings;
  if (j.contains("endpoint") && j["endpoint"].is_string())
    holdings.endpoint = j["endpoint"].get<std::string>();
  if (!j.contains("pieces") || !j["pieces"].is_array()) return holdings;
  for (const auto& p : j["pieces"]) {
    if (!p.is_array() || p.size() != 5 || !p[0].is_number_integer() || !p[1].is_number_integer() ||
        !p[2].is_number_integer() || !p[3].is_boolean() || !p[4].is_number_integer()) {
      continue;
    }
    const HeldPiece piece{p[0].get<int>(), p[1].get<int>(), p[2].get<std::int64_t>(), p[3].get<bool>(),
                          p[4].get<int>()};
    if (piece.world < 1 || piece.rank < 0 || piece.rank >= piece.world || piece.step < 0) continue;
    holdings.pieces.push_back(piece);
  }
  return holdings;
}

namespace {

std::string rankList(const std::vector<int>& ranks) {
  std::string text;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i == 8 && ranks.size() > 9)
      return text + " and " + std::to_string(ranks.size() - i) + " more";
    text += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  }
  return text;
}

}  // namespace

void dropAbandoned(std::vector<NodeHoldings>& nodes) {
  std::map<int, std::int64_t> firstStep;  // round -> the earliest step any node holds of it
  for (const auto& node : nodes) {
    for (const auto& p : node.pieces) {
      const auto [it, added] = firstStep.try_emplace(p.round, p.step);
      if (!added) it->second = std::min(it->second, p.step);
    }
  }
  for (auto& node : nodes) {
    std::erase_if(node.pieces, [&](const HeldPiece& p) {
      for (auto it = firstStep.upper_bound(p.round); it != firstStep.end(); ++it) {
        if (it->second <= p.step) return true;
      }
      return false;
    });
  }
}

SnapshotChoice chooseSnapshot(const std::vector<NodeHoldings>& nodes, int currentWorld) {
  // (world, step) -> the ranks some node holds there. Ranks are in [0, world) (parseHoldings).
  std::map<std::pair<int, std::int64_t>, std::set<int>> held;
  for (const auto& node : nodes) {
    for (const auto& p : node.pieces) held[{p.world, p.step}].insert(p.rank);
  }
  const auto newer = [currentWorld](int world, std::int64_t step, const SnapshotChoice& than) {
    if (than.world == 0 || step != than.step) return than.world == 0 || step > than.step;
    if ((world == currentWorld) != (than.world == currentWorld)) return world == currentWorld;
    return world > than.world;
  };
  SnapshotChoice best;
  SnapshotChoice newest;  // of any piece: what the line says when nothing is complete
  for (const auto& [key, ranks] : held) {
    const auto [world, step] = key;
    if (newer(world, step, newest)) newest = {step, world, ""};
    if (static_cast<int>(ranks.size()) == world && newer(world, step, best))
      best = {step, world, ""};
  }
  if (best.world > 0 || held.empty()) return best;
  const int world = newest.world;
  std::set<int> atAnyStep;
  for (const auto& [key, ranks] : held) {
    if (key.first == world) atAnyStep.insert(ranks.begin(), ranks.end());
  }
  std::vector<int> missing;
  for (int q = 0; q < world; ++q) {
    if (!atAnyStep.contains(q)) missing.push_back(q);
  }
  const std::string prefix =
      "no in-memory snapshot covers every rank of world " + std::to_string(world);
  if (missing.empty()) {
    best.why = prefix +
               " at one step (each rank is held, at steps that do not meet; the newest is " +
               std::to_string(newest.step) + "): resuming from disk";
  } else {
    best.why = prefix + " at any step: " + (missing.size() == 1 ? "rank " : "ranks ") +
               rankList(missing) + (missing.size() == 1 ? " is" : " are") +
               " held by no surviving node (a node and its peer-copy holder lost together?): "
               "resuming from disk";
  }
  return best;
}

std::vector<int> holdersOf(const std::vector<NodeHoldings>& nodes, int self, int rank, int world,
                           std::int64_t step) {
  std::vector<int> first, own, copies;
  for (int i = 0; i < static_cast<int>(nodes.size()); ++i) {
    bool holds = false, asOwn = false;
    for (const auto& p : nodes[static_cast<std::size_t>(i)].pieces) {
      if (p.rank != rank || p.world != world || p.step != step) continue;
      holds = true;
      asOwn = asOwn || !p.peer;
    }
    if (!holds) continue;
    (i == self ? first : asOwn ? own : copies).push_back(i);
  }
  first.insert(first.end(), own.begin(), own.end());
  first.insert(first.end(), copies.begin(), copies.end());
  return first;
}

namespace {

// Every node's holdings: this node's published by its local rank 0, all of them read back.
std::vector<NodeHoldings> gatherHoldings(const KeeperLink& link) {
  Runtime& rt = link.runtime;
  const auto& env = rt.env();
  const std::string prefix = rt.roundPrefix() + "snapshot/held/" +
                             (link.call > 0 ? std::to_string(link.call) + "/" : std::string());
  if (env.localRank == 0) {
    NodeHoldings mine;
    const char* endpoint = std::getenv("FSDPRUN_SNAPSHOT_PEER");
    mine.endpoint = endpoint != nullptr ? endpoint : "";
    try {
      const json list = link.ask({{"op", "list"}}, nullptr);
      for (const auto& p : list.at("pieces")) {
        mine.pieces.push_back({p.at("rank").get<int>(), p.at("world").get<int>(), p.at("step").get<std::int64_t>(),
                               p.value("peer", false), p.value("round", 0)});
      }
    } catch (const std::exception& e) {
      log::warn("rank {}: cannot list the agent's snapshots ({}): this node offers none", rt.rank(),
                e.what());
      mine.pieces.clear();
    }
    rt.store().set(prefix + std::to_string(env.groupRank), holdingsText(mine));
  }
  std::vector<std::string> keys;
  for (int g = 0; g < env.groupWorldSize; ++g) keys.push_back(prefix + std::to_string(g));
  RankWait waiting({.group = "snapshot", .rank = rt.rank(), .size = rt.worldSize(),
                    .what = "restore: waiting for every node's snapshots"});
  rt.store().wait(keys, link.timeout);
  waiting.done();
  std::vector<NodeHoldings> nodes;
  for (const auto& text : rt.store().multiGet(keys)) nodes.push_back(parseHoldings(text));
  return nodes;
}

// Rank `q`'s piece of `world` at `step`, from the first holder that hands it over. `fromPeer`:
// it is not this node's keeper's own piece.
Fd fetchFromHolders(const KeeperLink& link, const std::vector<NodeHoldings>& nodes, int q,
                    int world, std::int64_t step, const std::string& label, bool& fromPeer) {
  const int self = link.runtime.env().groupRank;
  std::string errors;
  // Fetching is this rank's own work (its agent's or another's memory), busy, not stalled.
  const LongOperation busy("snapshot fetch");
  for (const int holder : holdersOf(nodes, self, q, world, step)) {
    try {
      if (holder == self) {
        Fd fd;
        const json answer =
            link.ask({{"op", "get"}, {"rank", q}, {"world", world}, {"step", step}}, &fd);
        if (!answer.value("ok", false) || !fd) throw Error("this node's agent no longer holds it");
        fromPeer = answer.value("peer", false);
        return fd;
      }
      const auto& endpoint = nodes[static_cast<std::size_t>(holder)].endpoint;
      Fd fd = fetchPiece({endpoint, link.runtime.env().runId, link.token, q, world, step},
                         link.timeout);
      fromPeer = true;
      log::debug("rank {}: fetched rank {}'s part of {} from node {} ({})", link.runtime.rank(), q,
                 label, holder, endpoint);
      return fd;
    } catch (const std::exception& e) {
      errors += (errors.empty() ? "" : "; ") + std::string("node ") + std::to_string(holder) +
                ": " + e.what();
    }
  }
  throw ConfigError(label + ": rank " + std::to_string(q) +
                    "'s part could not be fetched from any node holding it (" +
                    (errors.empty() ? std::string("none does") : errors) + ")");
}

}  // namespace

std::optional<Restored> restoreFromKeepers(const KeeperLink& link, FullyShardedDataParallel& model,
                                           torch::optim::Optimizer* optimizer) {
  Runtime& rt = link.runtime;
  const int rank = rt.rank();
  const int world = rt.worldSize();
  std::vector<NodeHoldings> nodes = gatherHoldings(link);
  dropAbandoned(nodes);
  const SnapshotChoice choice = chooseSnapshot(nodes, world);
  // This rank's state either lies in the chosen snapshot's memory already (a survivor of a
  // re-formation, the same rank of the same world) or moves out of the memory the keeper holds
  // before anything writes it (another snapshot, another world, the disk).
  const bool keepOwn = link.ownStateHolds && link.ownStateHolds(choice.step, choice.world) && choice.world == world;
  if (choice.world == 0) {
    if (rank == 0 && !choice.why.empty()) log::warn("{}", choice.why);
    return std::nullopt;
  }
  const std::int64_t step = choice.step;
  const int oldWorld = choice.world;
  const bool sameWorld = oldWorld == world;
  const std::string label = "the in-memory snapshot of step " + std::to_string(step);

  // Fetch the pieces and lay them out as a checkpoint's files. The same world: this rank's own
  // piece. Another world (a reshard): every piece of it, as the loader may read any.
  std::string failure;
  Manifest m;
  m.path = label;
  std::vector<std::pair<int, Fd>> pieces;
  std::shared_ptr<char> ownMap;  // this rank's piece, mapped: its state is restored in place
  std::uint64_t ownBytes = 0;
  bool fromPeer = false;
  try {
    json files = json::array();
    json meta;
    for (int q = 0; q < oldWorld; ++q) {
      if (sameWorld && q != rank) {
        files.push_back({{"rank", q}, {"bytes", 0}, {"blocks", json::array()}});
        continue;
      }
      bool peer = false;
      Fd fd = fetchFromHolders(link, nodes, q, oldWorld, step, label, peer);
      fromPeer = fromPeer || peer;
      const std::string headerText =
          snapshot::readPieceHeader(fd.get(), label + " of rank " + std::to_string(q));
      const json header = json::parse(headerText);
      if (header.at("step").get<std::int64_t>() != step ||
          header.at("world").get<int>() != oldWorld || header.at("rank").get<int>() != q) {
        throw ConfigError(label + ": rank " + std::to_string(q) +
                          "'s part is of another step or world");
      }
      const std::uint64_t dataOffset = snapshot::dataOffsetFor(headerText.size());
      json blocks = json::array();
      // Across world sizes, each element is read from its primary replica only (NO_SHARD and
      // HYBRID_SHARD replicas hold the same values more than once).
      const bool primary = header.at("meta").value("primary_replica", true);
      for (auto b : header.at("blocks")) {
        const std::string what = b.at("what").get<std::string>();
        if (!sameWorld && !primary && (what == "param" || what.starts_with("optim/"))) continue;
        b["offset"] = b.at("offset").get<std::uint64_t>() + dataOffset;
        blocks.push_back(std::move(b));
      }
      const std::uint64_t bytes = snapshot::fileBytes(fd.get());
      if (sameWorld && !keepOwn && link.mapOwnPiece) {
        ownMap = link.mapOwnPiece(fd.get(), bytes, step, oldWorld);
        ownBytes = bytes;
      }
      files.push_back({{"rank", q}, {"bytes", bytes}, {"blocks", blocks}});
      if (meta.is_null()) meta = header.at("meta");
      pieces.emplace_back(q, std::move(fd));
    }
    meta["files"] = std::move(files);
    m = manifestFromMeta(std::move(meta), label);
    m.checkCrc = false;
  } catch (const std::exception& e) {
    failure = e.what();
  }
  Reader reader(m);
  if (ownMap) reader.mapped(rank, std::move(ownMap), ownBytes);
  for (auto& [q, fd] : pieces) {
    reader.adopt(q, std::make_unique<File>(fd.release(), label + " of rank " + std::to_string(q)));
  }
  try {
    // Every rank agrees here: a fetch that failed anywhere sends all of them to the disk.
    const CommTag restoring("snapshot", "restore");
    auto progress = loadManifest(
        rt, m, reader, model, optimizer,
        rt.roundPrefix() + "snapshot/load/" + std::to_string(step) + "/error", failure, keepOwn);
    auto from = at::full({1}, fromPeer ? 1.0 : 0.0, at::kDouble);
    const CommTag tag("snapshot", "restore");
    rt.cpuComm().allReduce(from, ReduceOp::kMax).wait();
    return Restored{progress, from.item<double>() > 0 ? "peer copy" : "memory"};
  } catch (const ConfigError& e) {
    if (rank == 0) log::warn("{} was refused: {}; resuming from disk", label, e.what());
    return std::nullopt;
  }
}

}  // namespace fsdp::worker::detail
