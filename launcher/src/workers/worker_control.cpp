// The agent's end of its workers' control channels (worker_group.hpp; the worker's end is
// worker/src/reform/control.hpp): who can survive a failure elsewhere, the abort notice, and the
// new round handed to the survivors while the failed workers start as new processes.
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "fsdp/common/deadline.hpp"
#include "fsdp/common/log.hpp"
#include "worker_group.hpp"

namespace fsdp::launcher::detail {
namespace {

// One message to a worker; false when it is gone (its end closed) or the channel is full.
bool sendControl(int fd, const nlohmann::json& message) {
  if (fd < 0) return false;
  const std::string text = message.dump();
  for (;;) {
    if (::send(fd, text.data(), text.size(), MSG_NOSIGNAL | MSG_DONTWAIT) >= 0) return true;
    if (errno != EINTR) return false;
  }
}

}  // namespace

void WorkerGroup::readControl(Worker& w) {
  std::string buffer(4096, '\0');
  for (;;) {
    const ssize_t n = ::recv(w.control, buffer.data(), buffer.size(), MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {  // the worker closed it (exited, or a program that closes what it inherits)
      ::close(w.control);
      w.control = -1;
      w.ready = false;
      return;
    }
    const auto message = nlohmann::json::parse(buffer.data(), buffer.data() + n, nullptr, false);
    if (message.is_discarded() || !message.is_object()) {
      // A worker may write anything; it only loses its own channel.
      log::warn("rank {}: its control channel sent something that is not a JSON object; closed", w.spec.rank);
      ::close(w.control);
      w.control = -1;
      w.ready = false;
      return;
    }
    if (const auto it = message.find("ready"); it != message.end() && it->is_boolean()) w.ready = it->get<bool>();
    if (const auto it = message.find("device_memory"); it != message.end() && it->is_boolean()) {
      w.deviceMemory = it->get<bool>();
    }
    if (const auto it = message.find("reformed"); it != message.end() && it->is_object()) {
      w.reforming = false;
      log::info("rank {} (pid {}) re-formed in process: round {}", w.spec.rank, w.process ? w.process->pid() : -1,
                it->value("round", -1));
    }
  }
}

std::set<int> WorkerGroup::reformable() const {
  std::set<int> out;
  for (const auto& w : workers_) {
    if (w.ready && w.control >= 0 && w.process && !w.reported && !w.exitTold) out.insert(w.spec.localRank);
  }
  return out;
}

std::set<int> WorkerGroup::reforming() const {
  std::set<int> out;
  for (const auto& w : workers_) {
    if (w.reforming && w.process && !w.reported && !w.exitTold) out.insert(w.spec.localRank);
  }
  return out;
}

std::set<int> WorkerGroup::runningLocalRanks() const {
  std::set<int> out;
  for (const auto& w : workers_) {
    if (w.process && !w.reported && !w.exitTold) out.insert(w.spec.localRank);
  }
  return out;
}

void WorkerGroup::notifyAbort(const std::set<int>& localRanks, const std::string& why) {
  for (auto& w : workers_) {
    if (!localRanks.contains(w.spec.localRank)) continue;
    // Not ready from now on: a second failure before it re-formed costs it its process.
    w.ready = false;
    w.reforming = true;
    if (!sendControl(w.control, {{"abort", why}})) {
      log::warn("rank {}: its control channel is gone; it is stopped instead", w.spec.rank);
      if (w.process && !w.process->reaped()) w.process->signal(SIGTERM);
    }
  }
}

void WorkerGroup::clearSlot(std::size_t index) {
  Worker& w = workers_[index];
  if (w.process && !w.reported && w.freesItselfUnreaped()) {
    // Dying, and what it holds the kernel frees without anyone waiting: reap() reaps it.
    dying_.push_back(std::move(*w.process));
    w.process.reset();
  } else if (w.process && !w.reported) {
    const pid_t pid = w.process->pid();
    w.process.reset();  // kills the process group and reaps it
    guardian_.forget(pid);
  }
  for (Stream* s : {&w.out, &w.err}) {
    if (s->fd >= 0) ::close(s->fd);
    if (s->fileFd >= 0) ::close(s->fileFd);
    *s = Stream{};
  }
  if (w.control >= 0) ::close(w.control);
  if (w.activation >= 0) ::close(w.activation);
  w.control = -1;
  w.activation = -1;
  w.ready = false;
  w.reforming = false;
  w.lifeline.reset();
  w.tail.clear();
  w.partial.clear();
  w.reported = false;
  w.exitTold = false;
  w.deviceMemory = true;
}

bool WorkerGroup::adoptSpare(std::size_t index, const WorkerSpec& spec, WorkerGroup& spares) {
  for (auto& s : spares.workers_) {
    if (s.spec.localRank != spec.localRank) continue;
    if (s.activation < 0 || !s.process || s.reported || s.process->reaped() || s.process->tryWait()) return false;
    if (s.spec.argv != spec.argv) return false;
    const auto was = envMap(s.spec.env);
    const auto now = envMap(spec.env);
    if (!identityChange(was, now, kStandbyIdentity, spec.localRank).empty()) return false;
    const std::string message = nlohmann::json{{"env", envChanges(was, now)}}.dump() + "\n";
    writeAll(s.activation, message.data(), message.size());
    ::close(s.activation);
    s.activation = -1;
    s.spec = spec;
    s.started = Deadline::Clock::now();
    clearSlot(index);
    workers_[index] = std::move(s);
    // Its lifeline reports to the spares' group: without it, its exit is learnt when reaped.
    workers_[index].lifeline.reset();
    // Moved: what the spares' group would close or kill on its way out is not its any more.
    s.process.reset();
    s.reported = true;
    s.out = Stream{};
    s.err = Stream{};
    s.control = -1;
    s.activation = -1;
    return true;
  }
  return false;
}

bool WorkerGroup::reform(const std::vector<WorkerSpec>& specs, const std::set<int>& kept, const std::string& attemptDir,
                         std::string& why, WorkerGroup* spares) {
  // RANK and WORLD_SIZE may change (a node lost or added): the worker lays its shards out again.
  static const std::vector<const char*> kIdentity = {"LOCAL_RANK", "LOCAL_WORLD_SIZE"};
  if (specs.size() != workers_.size()) {
    why = std::to_string(specs.size()) + " workers now, " + std::to_string(workers_.size()) + " before";
    return false;
  }
  std::vector<nlohmann::json> changes(workers_.size());
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    const auto& w = workers_[i];
    if (!kept.contains(w.spec.localRank) || w.reported || w.exitTold) continue;
    const auto was = envMap(w.spec.env);
    const auto now = envMap(specs[i].env);
    why = identityChange(was, now, kIdentity, w.spec.localRank);
    if (!why.empty()) return false;
    changes[i] = envChanges(was, now);
  }
  attemptDir_ = attemptDir;
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    auto& w = workers_[i];
    const bool alive = kept.contains(w.spec.localRank) && !w.reported && !w.exitTold && w.process;
    if (alive && sendControl(w.control, {{"reform", {{"env", changes[i]}}}})) {
      w.spec.env = specs[i].env;
      continue;
    }
    // The failed (or gone) worker's place: its spare, waiting with the program loaded, else a new
    // process.
    if (spares != nullptr && adoptSpare(i, specs[i], *spares)) {
      log::info("local rank {}: its spare (pid {}) takes the failed worker's place", specs[i].localRank,
                w.process ? w.process->pid() : -1);
      continue;
    }
    clearSlot(i);
    w.spec = specs[i];
    spawn(i, /*standby=*/false);
  }
  return true;
}

}  // namespace fsdp::launcher::detail
