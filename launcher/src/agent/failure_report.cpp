// The failure report: a failed worker's record as agents exchange it (JSON) and as the user
// reads it (describeFailure).
#include "fsdp/launcher/agent.hpp"

#include <sys/wait.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "agent_support.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"

namespace fsdp::launcher {
namespace {

std::string joinLines(const std::string& text, const std::string& indent) {
  std::string out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) out += indent + line + "\n";
  return out;
}

}  // namespace

std::string Failure::toJson() const {
  return nlohmann::json{{"rank", rank},
                        {"local_rank", localRank},
                        {"node", node},
                        {"pid", pid},
                        {"wait_status", waitStatus},
                        {"seconds_after_start", secondsAfterStart},
                        {"time", time},
                        {"restart_count", restartCount},
                        {"error", error},
                        {"stderr_tail", stderrTail},
                        {"hang", hang},
                        {"peers", peers}}
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Failure Failure::fromJson(const std::string& text) {
  const auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) throw ProtocolError("malformed failure report");
  try {
    return Failure{j.at("rank").get<int>(),
                   j.at("local_rank").get<int>(),
                   j.at("node").get<std::string>(),
                   j.at("pid").get<int>(),
                   j.at("wait_status").get<int>(),
                   j.at("seconds_after_start").get<double>(),
                   j.value("time", std::string()),
                   j.value("restart_count", 0),
                   j.value("error", std::string()),
                   j.value("stderr_tail", std::string()),
                   j.value("hang", std::string()),
                   j.value("peers", std::string())};
  } catch (const nlohmann::json::exception& e) {
    throw ProtocolError(std::string("malformed failure report: ") + e.what());
  }
}

std::string describeFailure(const Failure& f, int maxRestarts) {
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(3);
  if (!f.hang.empty()) {
    out << "the job hung";
    if (f.rank >= 0) out << ", rank " << f.rank << " (on " << f.node << ", pid " << f.pid << ") first";
    if (!f.time.empty()) out << ", at " << f.time;
    out << " (restart " << f.restartCount << " of " << maxRestarts << ")\n" << joinLines(f.hang, "  ");
    return out.str();
  }
  out << "rank " << f.rank << " (local_rank " << f.localRank << " on " << f.node << ", pid "
      << f.pid << ") failed first: " << describeWaitStatus(f.waitStatus) << ", "
      << f.secondsAfterStart << " s after it started";
  if (!f.time.empty()) out << ", at " << f.time;
  out << " (restart " << f.restartCount << " of " << maxRestarts << ")\n";
  if (!f.error.empty()) {
    out << "  its error (TORCHELASTIC_ERROR_FILE):\n" << joinLines(f.error, "    ");
  }
  if (!f.stderrTail.empty()) {
    // With the error at hand, a few lines of context are enough.
    std::string tail = f.stderrTail;
    if (!f.error.empty()) {
      std::size_t pos = tail.size();
      for (int lines = 0; lines < 6 && pos > 0; ++lines) pos = tail.rfind('\n', pos - 1);
      if (pos != std::string::npos && pos > 0) tail = tail.substr(pos + 1);
    }
    out << "  the last lines of its stderr:\n" << joinLines(tail, "    | ");
  }
  if (f.error.empty() && f.stderrTail.empty()) out << "  it wrote nothing to stderr\n";
  if (!f.peers.empty()) out << "  the other workers of its node, still running then:\n" << joinLines(f.peers, "    ");
  return out.str();
}

std::string torchrunErrorJson(const Failure& f, long long now) {
  std::string message;
  std::string stack;
  const auto split = [&](const std::string& text) {
    const auto eol = text.find('\n');
    message = text.substr(0, eol);
    stack = eol == std::string::npos ? "" : text.substr(eol + 1);
  };
  if (!f.hang.empty()) {
    split(f.hang);  // its first line says "the job is hung (declared by ...)"
  } else if (!f.error.empty()) {
    split(f.error);
  } else {
    message = "rank " + std::to_string(f.rank) + " (local_rank " + std::to_string(f.localRank) + " on " + f.node +
              ", pid " + std::to_string(f.pid) + ") failed: " + describeWaitStatus(f.waitStatus);
    stack = f.stderrTail;
  }
  // torchrun's exit code of a worker: its status, or minus the signal that ended it; 1 where no
  // exit ended the job (a hang: its lagging rank was still running), never a 0 that reads as success.
  const int code = WIFSIGNALED(f.waitStatus)                                  ? -WTERMSIG(f.waitStatus)
                   : WIFEXITED(f.waitStatus) && WEXITSTATUS(f.waitStatus) != 0 ? WEXITSTATUS(f.waitStatus)
                                                                               : 1;
  return detail::torchrunError(message, {{"py_callstack", stack}}, now, code)
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace fsdp::launcher
