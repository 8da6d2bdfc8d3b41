// The runs the server holds (created on first use, dropped when idle), each run's round timer,
// and the delivery of round events to the agents' connections.
#include "fsdp/common/log.hpp"
#include "server_state.hpp"
#include "../session_io.hpp"

namespace fsdp::rendezvous {

namespace asio = boost::asio;
using asio::awaitable;
using detail::TimePoint;

namespace {

// Where torch.distributed's env:// init keys everything when it uses the agent's store
// (TORCHELASTIC_USE_AGENT_STORE): PrefixStore("/worker/attempt_<n>"), which reaches the wire
// as "//worker/attempt_<n>/..." (PyTorch joins prefixes with a '/').
constexpr const char* kPytorchWorkerPrefixes[] = {"/worker/", "//worker/"};

}  // namespace

Run& StoreServer::Impl::bindRun(const std::string& id) {
  auto& slot = runs[id];
  if (!slot) {
    slot = std::make_unique<Run>();
    slot->id = id;
    slot->tick = std::make_unique<asio::steady_timer>(io);
    slot->tick->expires_at(TimePoint::max());
    asio::co_spawn(io, tickRun(slot.get()),
                   [](std::exception_ptr e) { logCoroutineError("a round timer", e); });
    log::debug("store server: run '{}' created", id);
  }
  ++slot->sessions;
  slot->lastActive = asio::steady_timer::clock_type::now();
  return *slot;
}

void StoreServer::Impl::wakeStalled() {
  for (const AgentId id : stalled) {
    if (const auto it = sessions.find(id); it != sessions.end()) it->second->wakeRoom();
  }
}

void StoreServer::Impl::rearm(Run& run) {
  const auto next = run.rounds.nextDeadline();
  // RoundState's clock is std::chrono::steady_clock, the same as the timer's.
  run.tick->expires_at(next ? *next : TimePoint::max());
}

awaitable<void> StoreServer::Impl::tickRun(Run* run) {
  while (!run->dropped && !stopped) {
    auto [ec] = co_await run->tick->async_wait(asio::as_tuple(kUseAwaitable));
    if (run->dropped || stopped) co_return;
    if (ec) continue;  // re-armed: wait for the new deadline
    deliver(*run, run->rounds.tick(Clock::now()));
    rearm(*run);
  }
}

void StoreServer::Impl::deliver(Run& run, const std::vector<Event>& events) {
  const bool pytorchRun = allowPytorch && run.id == options.pytorchRunId;
  bool assigned = false;
  for (Event event : events) {
    if (event.kind == EventKind::kAssigned) {
      // Once per round (its node rank 0's assignment), for whoever audits a run's history.
      if (event.assignment.nodeRank == 0) {
        log::info("store server: run '{}': round {} formed: {} nodes, world size {}, {} restarts",
                  run.id, event.assignment.round, event.assignment.nnodes,
                  event.assignment.worldSize, event.assignment.restartCount);
      }
      assigned = true;
      event.assignment.pytorchStore = pytorchRun;
    }
    if (event.kind == EventKind::kSpare) log::warn("store server: run '{}': {}", run.id, event.reason);
    const auto it = sessions.find(event.agent);
    if (it == sessions.end()) continue;
    Session& session = *it->second;
    Response resp;
    resp.number = static_cast<std::int64_t>(event.kind);
    resp.value = encodeEventPayload(event);
    session.send(encodeResponse(Op::kEvent, resp));
    if (event.kind == EventKind::kDisconnect || event.kind == EventKind::kJoinFailed) {
      session.closeAfterFlush();
    }
  }
  // PyTorch's clients of a round key everything under /worker/attempt_<restart count>, and a
  // round after a membership change keeps the count: drop what the previous round left (its
  // workers are gone: every member stopped them before re-joining).
  if (assigned && pytorchRun) {
    std::size_t dropped = 0;
    for (const char* prefix : kPytorchWorkerPrefixes) dropped += run.store.removePrefix(prefix);
    if (dropped > 0)
      log::debug("store server: run '{}': dropped {} keys of the previous round", run.id, dropped);
  }
}

awaitable<void> StoreServer::Impl::sweepRuns() {
  const auto every = std::max(std::chrono::milliseconds(100), options.runIdleTtl / 4);
  while (!stopped) {
    sweep.expires_after(every);
    co_await sweep.async_wait(asio::as_tuple(kUseAwaitable));
    if (stopped) co_return;
    const auto now = asio::steady_timer::clock_type::now();
    for (auto it = runs.begin(); it != runs.end();) {
      Run& run = *it->second;
      if (run.sessions == 0 && now - run.lastActive >= options.runIdleTtl) {
        log::info("store server: dropping idle run '{}' ({} keys)", run.id, run.store.size());
        run.dropped = true;
        run.tick->cancel();
        // The ticker coroutine still refers to the timer: let it finish before freeing.
        asio::post(io, [owned = std::shared_ptr<Run>(std::move(it->second))] {});
        it = runs.erase(it);
      } else {
        ++it;
      }
    }
  }
}

}  // namespace fsdp::rendezvous
