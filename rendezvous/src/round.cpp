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
              {"heartbeat_timeout_ms", j.heartbeatTimeout.count()},
              {"last_round", j.lastRound},
              {"last_rank", j.lastRank},
              {"restarts", j.restarts},
              {"program", j.program},
              {"serves", j.servesRendezvous},
              {"agent_id", j.agentId}}
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
    r.lastRound = j.value("last_round", -1);
    r.lastRank = j.value("last_rank", -1);
    r.restarts = j.value("restarts", 0);
    r.program = j.value("program", std::string());
    r.servesRendezvous = j.value("serves", false);
    r.agentId = j.value("agent_id", std::string());
    if (r.agentId.size() > 64) throw ProtocolError("JOIN: agent_id must be at most 64 bytes");
    if (r.lastRound < -1 || r.lastRank < -1 || r.restarts < 0) {
      throw ProtocolError("JOIN: last_round, last_rank and restarts must not be negative");
    }
    if (r.program.size() > 65536) throw ProtocolError("JOIN: program must be at most 64 KiB");
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

namespace {

json successorsJson(const std::vector<Successor>& successors) {
  json list = json::array();
  for (const auto& s : successors) {
    list.push_back({{"node", s.node}, {"address", s.address}, {"agent_id", s.agentId}});
  }
  return list;
}

std::vector<Successor> successorsFrom(const json& j) {
  std::vector<Successor> successors;
  if (!j.contains("successors")) return successors;
  for (const auto& s : j.at("successors")) {
    successors.push_back({s.at("node").get<std::string>(), s.at("address").get<std::string>(),
                          s.value("agent_id", std::string())});
    if (successors.size() > kMaxSuccessors) throw ProtocolError("more than " + std::to_string(kMaxSuccessors) + " successors");
  }
  return successors;
}

}  // namespace

std::string encodeAssignment(const Assignment& a) {
  return json{{"round", a.round},
              {"node_rank", a.nodeRank},
              {"rank_offset", a.rankOffset},
              {"world_size", a.worldSize},
              {"nnodes", a.nnodes},
              {"master_addr", a.masterAddr},
              {"master_port", a.masterPort},
              {"restart_count", a.restartCount},
              {"pytorch_store", a.pytorchStore},
              {"successors", successorsJson(a.successors)}}
      .dump();
}

Assignment decodeAssignment(const std::string& text) {
  try {
    const auto j = json::parse(text);
    return Assignment{j.at("round").get<int>(),       j.at("node_rank").get<int>(),
                      j.at("rank_offset").get<int>(), j.at("world_size").get<int>(),
                      j.at("nnodes").get<int>(),      j.at("master_addr").get<std::string>(),
                      j.at("master_port").get<int>(), j.value("restart_count", 0),
                      j.value("pytorch_store", false), successorsFrom(j)};
  } catch (const json::exception& e) {
    throw ProtocolError(std::string("malformed assignment: ") + e.what());
  }
}

std::string encodeEventPayload(const Event& event) {
  if (event.kind == EventKind::kAssigned) return encodeAssignment(event.assignment);
  json j{{"reason", event.reason}};
  if (!event.failure.empty()) j["failure"] = json::parse(event.failure, nullptr, false);
  if (event.kind == EventKind::kSpare) j["successors"] = successorsJson(event.assignment.successors);
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
  if (event.kind == EventKind::kSpare) {
    try {
      event.assignment.successors = successorsFrom(j);
    } catch (const json::exception& e) {
      throw ProtocolError(std::string("malformed spare event: ") + e.what());
    }
  }
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
  } else if (!request.program.empty() && !params_->program.empty() && request.program != params_->program) {
    return {Event{agent, EventKind::kJoinFailed, {},
                  "node " + request.node + " runs '" + request.program.substr(0, 300) + "' but the run runs '" +
                      params_->program.substr(0, 300) + "': refused"}};
  }
  if (params_->program.empty()) params_->program = request.program;
  // A server that took over goes on with the run's numbering and restart count.
  if (members_.empty() && request.lastRound > round_) round_ = request.lastRound;
  failures_ = std::max(failures_, request.restarts);
  const std::string node = request.node;
  waiting_.emplace(agent, Waiter{std::move(request), now, joinOrder_++});
  std::vector<Event> events;
  if (!members_.empty() && static_cast<int>(members_.size()) < params_->maxNodes) {
    events = endRunningRound(now, "node " + node + " joined");
  } else if (!members_.empty()) {
    events.push_back(spareEvent(agent, node));
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
  auto events = endRunningRound(now, "node " + node + " left: " + reason);
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
  auto events = endRunningRound(now, "node " + node + " asked to restart: " + reason, failure);
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
  // (The first one's leave ends the round: the others are no longer members by then, and their
  // leave only drops them from the next round's expected nodes.)
  std::vector<std::pair<AgentId, std::string>> silent;
  for (const auto& [agent, m] : members_) {
    if (now - m.lastSeen >= m.request.heartbeatTimeout) {
      silent.emplace_back(agent, "no heartbeat for " + std::to_string(m.request.heartbeatTimeout.count()) + " ms");
    }
  }
  for (const auto& [agent, why] : silent) {
    events.push_back({agent, EventKind::kDisconnect, {}, why});
    auto more = leave(agent, why, now);
    events.insert(events.end(), more.begin(), more.end());
  }
  // Joiners that waited too long for a round (spares wait while one runs).
  std::vector<AgentId> expired;
  for (const auto& [agent, w] : waiting_) {
    if (members_.empty() && now - std::max(w.joinedAt, idleSince_) >= w.request.joinTimeout) {
      expired.push_back(agent);
    }
  }
  const std::size_t came = waiting_.size();
  for (const AgentId agent : expired) {
    const auto& w = waiting_.at(agent);
    std::string why = "join timed out after " + std::to_string(w.request.joinTimeout.count()) + " ms: " +
                      std::to_string(came) + " of " + std::to_string(params_ ? params_->minNodes : 1) +
                      " nodes needed have joined";
    if (round_ >= 0) {
      why += " since round " + std::to_string(round_) +
             " ended; the other nodes are lost or cut off (a network partition): a side with fewer than "
             "the minimum nodes forms no round";
    }
    events.push_back({agent, EventKind::kJoinFailed, {}, why});
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
  if (members_.empty()) {
    for (const auto& [agent, w] : waiting_) consider(std::max(w.joinedAt, idleSince_) + w.request.joinTimeout);
  }
  return next;
}

std::vector<Event> RoundState::endRunningRound(Clock::time_point now, const std::string& reason,
                                               const std::string& failure) {
  std::vector<Event> events;
  if (!members_.empty()) idleSince_ = now;
  previous_.clear();
  for (const auto& [agent, m] : members_) {
    events.push_back({agent, EventKind::kRoundEnded, {}, reason, failure});
    previous_.push_back(agent);
  }
  members_.clear();
  return events;
}

Event RoundState::spareEvent(AgentId agent, const std::string& node) const {
  Event spare{agent, EventKind::kSpare, {},
              "run at its maximum of " + std::to_string(params_->maxNodes) + " nodes: node " + node +
                  " waits as a spare and takes the place of the next node lost"};
  spare.assignment.successors = successors_;
  return spare;
}

std::vector<Successor> RoundState::successorsOf(
    const std::vector<std::pair<AgentId, const JoinRequest*>>& ranked) const {
  std::vector<Successor> successors;
  for (const auto& [agent, r] : ranked) {
    if (r->servesRendezvous) continue;
    successors.push_back({r->node, r->address, r->agentId});
    if (successors.size() == kMaxSuccessors) break;
  }
  return successors;
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
  // A returning member: it was in the last round, so it keeps its node rank if it can.
  const auto returning = [this](const JoinRequest& r) { return r.lastRound == round_ && r.lastRank >= 0; };
  // Members: returning ones first (by their old rank), then the first joiners in join order
  // (preferred ranks first); the rest stay on as spares.
  std::vector<std::pair<AgentId, const Waiter*>> chosen;
  for (const auto& [agent, w] : waiting_) chosen.emplace_back(agent, &w);
  std::sort(chosen.begin(), chosen.end(), [&](const auto& a, const auto& b) {
    const auto& ra = a.second->request;
    const auto& rb = b.second->request;
    if (returning(ra) != returning(rb)) return returning(ra);
    if (returning(ra) && ra.lastRank != rb.lastRank) return ra.lastRank < rb.lastRank;
    if ((ra.preferredRank >= 0) != (rb.preferredRank >= 0)) return ra.preferredRank >= 0;
    if (ra.preferredRank != rb.preferredRank) return ra.preferredRank < rb.preferredRank;
    return a.second->order < b.second->order;
  });
  if (static_cast<int>(chosen.size()) > params_->maxNodes) chosen.resize(params_->maxNodes);
  const int n = static_cast<int>(chosen.size());
  // Node ranks. Returning members keep theirs when all fit below n (newcomers fill the holes a
  // lost node left, in the order of the first round's rule); else every member closes ranks
  // in its old order. A first round: preferred rank first, then node name, then agent id.
  const auto firstRoundOrder = [](const auto& a, const auto& b) {
    const auto& ra = a.second->request;
    const auto& rb = b.second->request;
    const bool pa = ra.preferredRank >= 0;
    const bool pb = rb.preferredRank >= 0;
    if (pa != pb) return pa;
    if (pa && ra.preferredRank != rb.preferredRank) return ra.preferredRank < rb.preferredRank;
    if (ra.node != rb.node) return ra.node < rb.node;
    return a.first < b.first;
  };
  std::vector<std::pair<AgentId, const Waiter*>> ranked(static_cast<std::size_t>(n), {0, nullptr});
  std::vector<std::pair<AgentId, const Waiter*>> newcomers;
  bool keep = true;
  std::vector<bool> taken(static_cast<std::size_t>(n), false);
  for (const auto& c : chosen) {
    const int last = c.second->request.lastRank;
    if (!returning(c.second->request)) {
      newcomers.push_back(c);
    } else if (last >= n || taken[static_cast<std::size_t>(last)]) {
      keep = false;
    } else {
      taken[static_cast<std::size_t>(last)] = true;
    }
  }
  if (keep) {
    for (const auto& c : chosen) {
      if (returning(c.second->request)) ranked[static_cast<std::size_t>(c.second->request.lastRank)] = c;
    }
    std::sort(newcomers.begin(), newcomers.end(), firstRoundOrder);
    auto next = newcomers.begin();
    for (auto& slot : ranked) {
      if (slot.second == nullptr) slot = *next++;
    }
  } else {
    const auto old = static_cast<std::size_t>(chosen.size() - newcomers.size());  // returning, by old rank
    std::sort(newcomers.begin(), newcomers.end(), firstRoundOrder);
    std::copy(chosen.begin(), chosen.begin() + static_cast<std::ptrdiff_t>(old), ranked.begin());
    std::copy(newcomers.begin(), newcomers.end(), ranked.begin() + static_cast<std::ptrdiff_t>(old));
  }
  chosen = std::move(ranked);
  ++round_;
  int worldSize = 0;
  for (const auto& [agent, w] : chosen) worldSize += w->request.localWorldSize;
  const auto& master = chosen.front().second->request;
  std::vector<std::pair<AgentId, const JoinRequest*>> members;
  for (const auto& [agent, w] : chosen) members.emplace_back(agent, &w->request);
  successors_ = successorsOf(members);
  std::vector<Event> events;
  int offset = 0;
  for (std::size_t i = 0; i < chosen.size(); ++i) {
    const auto& [agent, w] = chosen[i];
    events.push_back({agent, EventKind::kAssigned,
                      Assignment{round_, static_cast<int>(i), offset, worldSize,
                                 static_cast<int>(chosen.size()), master.address, master.masterPort,
                                 failures_, false, successors_},
                      {}});
    offset += w->request.localWorldSize;
  }
  for (const auto& [agent, w] : chosen) {
    members_.emplace(agent, Member{w->request, now});
    waiting_.erase(agent);
  }
  // Who is left over waits as a spare, told so (with the successors, should the server go).
  for (const auto& [agent, w] : waiting_) events.push_back(spareEvent(agent, w.request.node));
  lastCallAt_.reset();
  previous_.clear();
  return events;
}

}  // namespace fsdp::rendezvous
