#include "fsdp/launcher/agent.hpp"

#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fcntl.h>

#include <cerrno>
#include <filesystem>
#include <cstdio>
#include <map>
#include <sstream>

#include "fsdp/common/deadline.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/common/sha256.hpp"
#include "fsdp/rendezvous/store_server.hpp"

namespace fsdp::launcher {
namespace {

constexpr int kHandledSignals[] = {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT};

// Owns the signalfd and the blocked mask of the signals the agent handles.
class SignalFd {
 public:
  SignalFd() {
    sigemptyset(&mask_);
    for (int sig : kHandledSignals) sigaddset(&mask_, sig);
    if (::sigprocmask(SIG_BLOCK, &mask_, &previous_) != 0) throwErrno("sigprocmask", errno);
    fd_ = ::signalfd(-1, &mask_, SFD_CLOEXEC | SFD_NONBLOCK);
    if (fd_ < 0) throwErrno("signalfd", errno);
  }
  ~SignalFd() {
    ::close(fd_);
    ::sigprocmask(SIG_SETMASK, &previous_, nullptr);
  }
  SignalFd(const SignalFd&) = delete;
  SignalFd& operator=(const SignalFd&) = delete;

  // Waits up to `timeout` (negative = forever) for signals; returns those that arrived.
  std::vector<int> wait(std::chrono::milliseconds timeout) {
    pollfd pfd{fd_, POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(timeout.count()));
    if (r < 0 && errno != EINTR) throwErrno("poll signalfd", errno);
    std::vector<int> out;
    signalfd_siginfo info{};
    while (::read(fd_, &info, sizeof(info)) == sizeof(info)) {
      out.push_back(static_cast<int>(info.ssi_signo));
    }
    return out;
  }

 private:
  sigset_t mask_{};
  sigset_t previous_{};
  int fd_ = -1;
};

// A free TCP port on the loopback interface, for MASTER_PORT (as torchrun picks one).
int freePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throwErrno("socket", errno);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd);
    throwErrno("choosing a free port", err);
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

// The job token, in a file only this user can read, removed with the object. Workers get the
// path (FSDPRUN_TOKEN_FILE), never the token in their environment or command line.
class TokenFile {
 public:
  TokenFile() : token_(toHex(randomBytes(32))) {
    std::string dir = (std::filesystem::temp_directory_path() / "fsdprun-XXXXXX").string();
    if (::mkdtemp(dir.data()) == nullptr) throwErrno("mkdtemp for the job token", errno);
    dir_ = dir;
    path_ = dir_ + "/token";
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) throwErrno("creating " + path_, errno);
    const bool ok = ::write(fd, token_.data(), token_.size()) == static_cast<ssize_t>(token_.size());
    ::close(fd);
    if (!ok) throwErrno("writing " + path_, errno);
  }
  ~TokenFile() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  const std::string& token() const { return token_; }
  const std::string& path() const { return path_; }

 private:
  std::string token_;
  std::string dir_;
  std::string path_;
};

struct Worker {
  WorkerIdentity id;
  ChildProcess process;
  Deadline::Clock::time_point started;
};

enum class GroupOutcome { kSucceeded, kFailed, kSignalled };

}  // namespace

std::vector<std::string> workerEnvironment(const LaunchOptions& options, const WorkerIdentity& id,
                                           const std::string& storeHost, int storePort,
                                           int masterPort, std::vector<std::string> base,
                                           const std::string& tokenFile) {
  std::map<std::string, std::string> set = {
      {"RANK", std::to_string(id.rank)},
      {"LOCAL_RANK", std::to_string(id.localRank)},
      {"WORLD_SIZE", std::to_string(id.worldSize)},
      {"LOCAL_WORLD_SIZE", std::to_string(id.localWorldSize)},
      {"GROUP_RANK", std::to_string(id.groupRank)},
      {"GROUP_WORLD_SIZE", std::to_string(id.groupWorldSize)},
      {"ROLE_RANK", std::to_string(id.rank)},
      {"ROLE_WORLD_SIZE", std::to_string(id.worldSize)},
      {"ROLE_NAME", options.role},
      {"MASTER_ADDR", options.masterAddr},
      {"MASTER_PORT", std::to_string(masterPort)},
      {"TORCHELASTIC_RUN_ID", options.rdzvId},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(id.restartCount)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(options.maxRestarts)},
      {"TORCHELASTIC_USE_AGENT_STORE", "False"},
      {"FSDPRUN_STORE_ADDR", storeHost},
      {"FSDPRUN_STORE_PORT", std::to_string(storePort)},
      {"FSDPRUN_ROUND", std::to_string(id.round)},
      {"FSDPRUN_LOCAL_ADDR", storeHost},
  };
  if (!tokenFile.empty()) set["FSDPRUN_TOKEN_FILE"] = tokenFile;
  std::vector<std::string> env;
  bool haveOmp = false;
  for (auto& entry : base) {
    const std::string key = entry.substr(0, entry.find('='));
    if (key == "OMP_NUM_THREADS") haveOmp = true;
    if (!set.contains(key)) env.push_back(std::move(entry));
  }
  if (!haveOmp) env.push_back("OMP_NUM_THREADS=1");
  for (const auto& [key, value] : set) env.push_back(key + "=" + value);
  return env;
}

std::string describeFailure(const Failure& f) {
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(3);
  out << "rank " << f.rank << " (local_rank " << f.localRank << ", pid " << f.pid
      << ") failed first: " << describeWaitStatus(f.waitStatus) << ", " << f.secondsAfterStart
      << " s after it started (attempt " << f.attempt << ")";
  return out.str();
}

AgentResult runStandalone(const LaunchOptions& options, const std::vector<std::string>& command) {
  SignalFd signals;  // before any thread starts, so that every thread inherits the mask
  const TokenFile token;
  rendezvous::StoreServer store(
      rendezvous::ServerOptions{.host = "127.0.0.1", .port = 0, .token = token.token()});
  const int masterPort = options.masterPort.value_or(freePort());
  const auto baseEnv = currentEnvironment();
  log::debug("store on 127.0.0.1:{}, {} worker(s), MASTER_PORT {}", store.port(),
            options.nprocPerNode, masterPort);

  AgentResult result;
  for (int attempt = 0;; ++attempt) {
    std::vector<Worker> workers;
    workers.reserve(options.nprocPerNode);
    for (int local = 0; local < options.nprocPerNode; ++local) {
      WorkerIdentity id{.localRank = local,
                        .rank = local,
                        .worldSize = options.nprocPerNode,
                        .localWorldSize = options.nprocPerNode,
                        .groupRank = 0,
                        .groupWorldSize = 1,
                        .restartCount = attempt,
                        .round = attempt};
      SpawnOptions spawn{.argv = command,
                         .env = workerEnvironment(options, id, "127.0.0.1", store.port(),
                                                  masterPort, baseEnv, token.path())};
      workers.push_back(Worker{id, ChildProcess::spawn(spawn), Deadline::Clock::now()});
    }

    std::optional<Failure> failure;
    std::optional<int> stopSignal;
    std::size_t running = workers.size();
    while (running > 0 && !failure && !stopSignal) {
      for (int sig : signals.wait(std::chrono::milliseconds(-1))) {
        if (sig != SIGCHLD) stopSignal = sig;
      }
      running = 0;
      for (auto& w : workers) {
        const bool wasRunning = !w.process.reaped();
        const auto status = w.process.tryWait();
        if (!status) {
          ++running;
          continue;
        }
        if (wasRunning && *status != 0 && !failure) {
          failure = Failure{w.id.rank, w.id.localRank, w.process.pid(), *status,
                            std::chrono::duration<double>(Deadline::Clock::now() - w.started).count(),
                            attempt};
        }
      }
    }

    if (running > 0) {
      // Stop the rest of the group: the signal that stopped us (or SIGTERM), then SIGKILL.
      const int sig = stopSignal.value_or(SIGTERM);
      for (auto& w : workers) w.process.signal(sig);
      const Deadline deadline = Deadline::after(options.shutdownTimeout);
      for (auto& w : workers) {
        if (!w.process.waitFor(deadline.remaining())) {
          log::warn("worker rank {} (pid {}) ignored {} for {} ms: sending SIGKILL", w.id.rank,
                    w.process.pid(), signalName(sig), options.shutdownTimeout.count());
          w.process.signal(SIGKILL);
          w.process.waitFor(std::chrono::seconds(10));
        }
      }
    }
    if (stopSignal) {
      log::warn("received {}: stopped every worker", signalName(*stopSignal));
      result.exitCode = 128 + *stopSignal;
      return result;
    }
    if (!failure) {
      result.exitCode = 0;
      return result;
    }
    if (attempt >= options.maxRestarts) {
      result.firstFailure = failure;
      result.exitCode = 1;
      return result;
    }
    ++result.restarts;
    log::warn("{}; restarting the worker group ({} of {} restarts)", describeFailure(*failure),
              attempt + 1, options.maxRestarts);
  }
}

}  // namespace fsdp::launcher
