#include "fsdp/rendezvous/round.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "fsdp/common/error.hpp"

namespace fsdp::rendezvous {

using nlohmann::json;

std::string encodeJoin(const JoinRequest& j) {
  return json{{"node", j.node},
              {"address", j.address},
              {"local_world_size", j.localWorldSize},
              {"preferred_rank", j.preferredRank},
              {"master_port", j.masterPort},
              {"min_nodes", j.minNodes},
              {"max_nodes", j.maxNodes},
              {"max_restarts", j.maxRestarts},
              {"last_call_ms", j.lastCallTimeout.count()},
              {"join_timeout_ms", j.joinTimeout.count()},
              {"heartbeat_timeout_ms", j.heartbeatTimeout.count()}}
      .dump();
}

JoinRequest decodeJoin(const std::string& text) {
  try {
    const auto j = json::parse(text);
    JoinRequest r;
    r.node = j.at("node").get<std::string>();
    r.address = j.at("address").get<std::string>();
    r.localWorldSize = j.at("local_world_size").get<int>();
    r.preferredRank = j.at("preferred_rank").get<int>();
    r.masterPort = j.at("master_port").get<int>();
    r.minNodes = j.at("min_nodes").get<int>();
    r.maxNodes = j.at("max_nodes").get<int>();
    r.maxRestarts = j.value("max_restarts", 0);
    r.lastCallTimeout = std::chrono::milliseconds(j.at("last_call_ms").get<std::int64_t>());
    r.joinTimeout = std::chrono::milliseconds(j.at("join_timeout_ms").get<std::int64_t>());
    r.heartbeatTimeout = std::chrono::milliseconds(j.at("heartbeat_timeout_ms").get<std::int64_t>());
    if (r.node.empty() || r.node.size() > 255) throw ProtocolError("JOIN: node name must be 1-255 bytes");
    if (r.localWorldSize < 1 || r.localWorldSize > 65536) {
      throw ProtocolError("JOIN: local_world_size " + std::to_string(r.localWorldSize) + " out of range");
    }
    if (r.minNodes < 1 || r.maxNodes < r.minNodes || r.maxNodes > 1'000'000) {
      throw ProtocolError("JOIN: nodes " + std::to_string(r.minNodes) + ":" + std::to_string(r.maxNodes) +
                          " out of range");
    }
    if (r.maxRestarts < 0) throw ProtocolError("JOIN: max_restarts must not be negative");
    if (r.lastCallTimeout.count() < 0 || r.joinTimeout.count() <= 0 || r.heartbeatTimeout.count() <= 0) {
      throw ProtocolError("JOIN: timeouts must be positive");
    }
    return r;
  } catch (const json::exception& e) {
    throw ProtocolError(std::string("JOIN: malformed request: ") + e.what());
  }
}

std::string encodeAssignment(const Assignment& a) {
  return json{{"round", a.round},
              {"node_rank", a.nodeRank},
              {"rank_offset", a.rankOffset},
              {"world_size", a.worldSize},
              {"nnodes", a.nnodes},
              {"master_addr", a.masterAddr},
              {"master_port", a.masterPort},
              {"restart_count", a.restartCount},
              {"pytorch_store", a.pytorchStore}}
      .dump();
}

Assignment decodeAssignment(const std::string& text) {
  try {
    const auto j = json::parse(text);
    return Assignment{j.at("round").get<int>(),       j.at("node_rank").get<int>(),
                      j.at("rank_offset").get<int>(), j.at("world_size").get<int>(),
                      j.at("nnodes").get<int>(),      j.at("master_addr").get<std::string>(),
                      j.at("master_port").get<int>(), j.value("restart_count", 0),
                      j.value("pytorch_store", false)};
  } catch (const json::exception& e) {
    throw ProtocolError(std::string("malformed assignment: ") + e.what());
  }
}

std::string encodeEventPayload(const Event& event) {
  if (event.kind == EventKind::kAssigned) return encodeAssignment(event.assignment);
  json j{{"reason", event.reason}};
  if (!event.failure.empty()) j["failure"] = json::parse(event.failure, nullptr, false);
  return j.dump();
}

void decodeEventPayload(const std::string& payload, Event& event) {
  if (event.kind == EventKind::kAssigned) {
    event.assignment = decodeAssignment(payload);
    return;
  }
  const auto j = json::parse(payload, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("reason") || !j["reason"].is_string()) {
    throw ProtocolError("malformed event payload: " + payload.substr(0, 200));
  }
  event.reason = j["reason"].get<std::string>();
  if (j.contains("failure") && !j["failure"].is_null()) event.failure = j["failure"].dump();
}

std::vector<Event> RoundState::join(AgentId agent, JoinRequest request, Clock::time_point now) {
  if (closed_) return {Event{agent, EventKind::kRunClosed, {}, closeReason_}};
  if (members_.contains(agent) || waiting_.contains(agent)) {
    return {Event{agent, EventKind::kJoinFailed, {}, "this connection already joined"}};
  }
  if (!params_) {
    params_ = request;
  } else if (request.minNodes != params_->minNodes || request.maxNodes != params_->maxNodes) {
    return {Event{agent, EventKind::kJoinFailed, {},
                  "node " + request.node + " asks for " + std::to_string(request.minNodes) + ":" +
                      std::to_string(request.maxNodes) + " nodes but the run has " +
                      std::to_string(params_->minNodes) + ":" + std::to_string(params_->maxNodes)}};
  } else if (request.maxRestarts != params_->maxRestarts) {
    return {Event{agent, EventKind::kJoinFailed, {},
                  "node " + request.node + " asks for --max_restarts " +
                      std::to_string(request.maxRestarts) + " but the run has " +
                      std::to_string(params_->maxRestarts)}};
  }
  const std::string node = request.node;
  waiting_.emplace(agent, Waiter{std::move(request), now, joinOrder_++});
  std::vector<Event> events;
  if (!members_.empty() && static_cast<int>(members_.size()) < params_->maxNodes) {
    events = endRunningRound("node " + node + " joined");
  }
  auto more = tryComplete(now, false);
  events.insert(events.end(), more.begin(), more.end());
  return events;
}

std::vector<Event> RoundState::leave(AgentId agent, const std::string& reason, Clock::time_point now) {
  std::erase(previous_, agent);  // no longer expected back
  if (waiting_.erase(agent) > 0) {
    if (params_ && static_cast<int>(waiting_.size()) < params_->minNodes) lastCallAt_.reset();
    return tryComplete(now, false);
  }
  const auto it = members_.find(agent);
  if (it == members_.end()) return {};
  const std::string node = it->second.request.node;
  members_.erase(it);
  auto events = endRunningRound("node " + node + " left: " + reason);
  auto more = tryComplete(now, false);
  events.insert(events.end(), more.begin(), more.end());
  return events;
}

void RoundState::heartbeat(AgentId agent, Clock::time_point now) {
  if (const auto it = members_.find(agent); it != members_.end()) it->second.lastSeen = now;
}

std::vector<Event> RoundState::endRound(AgentId agent, const std::string& reason,
                                        Clock::time_point now, const std::string& failure) {
  // A request from a node that is no longer a member (its round already ended, and the news
  // crossed its request) changes nothing.
  const auto it = members_.find(agent);
  if (it == members_.end()) return {};
  const std::string node = it->second.request.node;
  if (!failure.empty() && ++failures_ > params_->maxRestarts) {
    return finish(EventKind::kRunFailed,
                  "node " + node + ": " + reason + "; no restart left (" +
                      std::to_string(params_->maxRestarts) + " of " +
                      std::to_string(params_->maxRestarts) + " used)",
                  failure);
  }
  auto events = endRunningRound("node " + node + " asked to restart: " + reason, failure);
  auto more = tryComplete(now, false);
  events.insert(events.end(), more.begin(), more.end());
  return events;
}

std::vector<Event> RoundState::succeeded(AgentId agent) {
  const auto it = members_.find(agent);
  if (it == members_.end()) return {};
  it->second.succeeded = true;
  const bool all = std::all_of(members_.begin(), members_.end(),
                               [](const auto& entry) { return entry.second.succeeded; });
  if (!all) return {};
  return finish(EventKind::kRunFinished,
                "the run finished: the workers of all " + std::to_string(members_.size()) +
                    " node(s) succeeded",
                "");
}

std::vector<Event> RoundState::close(const std::string& reason) {
  return finish(EventKind::kRunClosed, reason, "");
}

std::vector<Event> RoundState::finish(EventKind kind, const std::string& reason,
                                      const std::string& failure) {
  std::vector<Event> events;
  if (closed_) return events;
  closed_ = true;
  closeReason_ = reason;
  for (const auto& [agent, m] : members_) events.push_back({agent, kind, {}, reason, failure});
  for (const auto& [agent, w] : waiting_) events.push_back({agent, kind, {}, reason, failure});
  members_.clear();
  waiting_.clear();
  previous_.clear();
  lastCallAt_.reset();
  return events;
}

std::vector<Event> RoundState::tick(Clock::time_point now) {
  std::vector<Event> events;
  // Silent members: the server must drop their connections; that ends the round.
  std::vector<AgentId> silent;
  for (const auto& [agent, m] : members_) {
    if (now - m.lastSeen >= m.request.heartbeatTimeout) silent.push_back(agent);
  }
  for (const AgentId agent : silent) {
    const auto timeout = members_.at(agent).request.heartbeatTimeout;
    events.push_back({agent, EventKind::kDisconnect, {},
                      "no heartbeat for " + std::to_string(timeout.count()) + " ms"});
    auto more = leave(agent, "no heartbeat for " + std::to_string(timeout.count()) + " ms", now);
    events.insert(events.end(), more.begin(), more.end());
  }
  // Joiners that waited too long.
  std::vector<AgentId> expired;
  for (const auto& [agent, w] : waiting_) {
    if (now - w.joinedAt >= w.request.joinTimeout) expired.push_back(agent);
  }
  for (const AgentId agent : expired) {
    const auto& w = waiting_.at(agent);
    events.push_back({agent, EventKind::kJoinFailed, {},
                      "join timed out after " + std::to_string(w.request.joinTimeout.count()) +
                          " ms: " + std::to_string(waiting_.size()) + " of " +
                          std::to_string(params_ ? params_->minNodes : 1) +
                          " nodes needed have joined"});
    waiting_.erase(agent);
  }
  if (params_ && static_cast<int>(waiting_.size()) < params_->minNodes) lastCallAt_.reset();
  const bool lastCall = lastCallAt_ && now >= *lastCallAt_;
  auto more = tryComplete(now, lastCall);
  events.insert(events.end(), more.begin(), more.end());
  return events;
}

std::optional<Clock::time_point> RoundState::nextDeadline() const {
  std::optional<Clock::time_point> next = lastCallAt_;
  const auto consider = [&next](Clock::time_point t) {
    if (!next || t < *next) next = t;
  };
  for (const auto& [agent, m] : members_) consider(m.lastSeen + m.request.heartbeatTimeout);
  for (const auto& [agent, w] : waiting_) consider(w.joinedAt + w.request.joinTimeout);
  return next;
}

std::vector<Event> RoundState::endRunningRound(const std::string& reason,
                                               const std::string& failure) {
  std::vector<Event> events;
  previous_.clear();
  for (const auto& [agent, m] : members_) {
    events.push_back({agent, EventKind::kRoundEnded, {}, reason, failure});
    previous_.push_back(agent);
  }
  members_.clear();
  return events;
}

void RoundState::armLastCall(Clock::time_point now) {
  if (!lastCallAt_) lastCallAt_ = now + params_->lastCallTimeout;
}

std::vector<Event> RoundState::tryComplete(Clock::time_point now, bool lastCallExpired) {
  if (!params_ || !members_.empty() || closed_) return {};
  const auto count = static_cast<int>(waiting_.size());
  if (count < params_->minNodes) return {};
  // After a restart nobody else is coming once the previous members are all back.
  const bool previousBack =
      !previous_.empty() && std::all_of(previous_.begin(), previous_.end(),
                                        [this](AgentId a) { return waiting_.contains(a); });
  if (count < params_->maxNodes && !lastCallExpired && !previousBack) {
    armLastCall(now);
    if (params_->lastCallTimeout.count() > 0) return {};
  }
  // Members: the first max_nodes joiners, in join order; the rest stay on standby.
  std::vector<std::pair<AgentId, const Waiter*>> chosen;
  for (const auto& [agent, w] : waiting_) chosen.emplace_back(agent, &w);
  std::sort(chosen.begin(), chosen.end(),
            [](const auto& a, const auto& b) { return a.second->order < b.second->order; });
  if (static_cast<int>(chosen.size()) > params_->maxNodes) chosen.resize(params_->maxNodes);
  // Deterministic node ranks: preferred rank first, then node name, then agent id.
  std::sort(chosen.begin(), chosen.end(), [](const auto& a, const auto& b) {
    const auto& ra = a.second->request;
    const auto& rb = b.second->request;
    const bool pa = ra.preferredRank >= 0;
    const bool pb = rb.preferredRank >= 0;
    if (pa != pb) return pa;
    if (pa && ra.preferredRank != rb.preferredRank) return ra.preferredRank < rb.preferredRank;
    if (ra.node != rb.node) return ra.node < rb.node;
    return a.first < b.first;
  });
  ++round_;
  int worldSize = 0;
  for (const auto& [agent, w] : chosen) worldSize += w->request.localWorldSize;
  const auto& master = chosen.front().second->request;
  std::vector<Event> events;
  int offset = 0;
  for (std::size_t i = 0; i < chosen.size(); ++i) {
    const auto& [agent, w] = chosen[i];
    events.push_back({agent, EventKind::kAssigned,
                      Assignment{round_, static_cast<int>(i), offset, worldSize,
                                 static_cast<int>(chosen.size()), master.address, master.masterPort,
                                 failures_},
                      {}});
    offset += w->request.localWorldSize;
  }
  for (const auto& [agent, w] : chosen) {
    members_.emplace(agent, Member{w->request, now});
    waiting_.erase(agent);
  }
  lastCallAt_.reset();
  previous_.clear();
  return events;
}

}  // namespace fsdp::rendezvous
