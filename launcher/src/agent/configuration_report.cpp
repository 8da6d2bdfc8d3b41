// The --dry_run report: the resolved configuration and where each value came from.
#include "fsdp/launcher/agent.hpp"

#include <sstream>
#include <string>
#include <vector>

namespace fsdp::launcher {

std::string describeConfiguration(const LaunchOptions& o, const std::vector<std::string>& command) {
  std::ostringstream out;
  const auto line = [&](const std::string& key, const std::string& value) {
    const auto it = o.sources.find(key);
    out << key << ": " << value << "  (" << (it == o.sources.end() ? "default" : it->second)
        << ")\n";
  };
  const auto plan = planRendezvous(o);
  line("nnodes", o.minNodes == o.maxNodes ? std::to_string(o.minNodes)
                                          : std::to_string(o.minNodes) + ":" + std::to_string(o.maxNodes));
  line("nproc_per_node", std::to_string(o.nprocPerNode));
  if (plan.embedded) {
    out << "rendezvous: embedded on 127.0.0.1 (a free port), one node\n";
  } else {
    line("rdzv_backend", o.rdzvBackend);
    line(o.rdzvBackend == "static" && o.rdzvEndpoint.empty() ? "master_addr" : "rdzv_endpoint",
         plan.endpoint.str());
    out << "rendezvous host: "
        << (plan.mustHost ? "this node (is_host=true)"
            : plan.mayHost ? "this node, unless the port is already served"
                           : "another node")
        << "\n";
  }
  line("node_rank", o.nodeRank ? std::to_string(*o.nodeRank) : "assigned by the rendezvous");
  line("rdzv_id", o.rdzvId);
  line("max_restarts", std::to_string(o.maxRestarts));
  line("restart_mode", o.restartMode == "auto"
                           ? "auto (the workers of a libfsdp training loop survive a failure elsewhere in process)"
                           : "process (every worker starts again after a failure)");
  line("standby", o.standby ? "a spare of each worker waits in fsdp::init() for the next restart" : "off");
  line("role", o.role);
  if (!o.localAddr.empty()) line("local_addr", o.localAddr);
  if (!o.logDir.empty()) line("log_dir", o.logDir);
  std::ostringstream timeout;
  timeout << o.shutdownTimeout.count() / 1000.0 << " s";
  line("shutdown_timeout", timeout.str());
  line("snapshot_memory_limit", o.maxRestarts > 0 ? std::to_string(o.snapshotMemoryLimit >> 20) + " MiB"
                                                  : "unused (--max_restarts 0: no restart to resume)");
  const auto& c = o.rdzvConf;
  out << "rdzv_conf: join_timeout=" << c.joinTimeout.count() / 1000.0
      << " last_call_timeout=" << c.lastCallTimeout.count() / 1000.0
      << " heartbeat_interval=" << c.heartbeatInterval.count() / 1000.0
      << " heartbeat_timeout=" << c.heartbeatTimeout.count() / 1000.0 << "  ("
      << o.sources.at("rdzv_conf") << ")\n";
  out << "command:";
  for (const auto& arg : command) out << ' ' << arg;
  out << '\n';
  return out.str();
}

}  // namespace fsdp::launcher
