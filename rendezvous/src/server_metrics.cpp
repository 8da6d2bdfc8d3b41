// The rendezvous server's figures as metrics (server_metrics.hpp).
#include "fsdp/rendezvous/server_metrics.hpp"

namespace fsdp::rendezvous {

void writeServerMetrics(prom::TextWriter& out, const ServerStats& s) {
  const auto perRun = [&](const char* name, const char* type, const char* help, auto value) {
    out.family(name, type, help);
    for (const auto& run : s.perRun) out.sample({{"job", run.id}}, static_cast<double>(value(run)));
  };
  using Run = ServerStats::Run;
  perRun("fsdprun_rendezvous_rounds_total", "counter", "Rounds formed in the run (the newest round's number + 1)",
         [](const Run& r) { return r.round + 1; });
  perRun("fsdprun_rendezvous_restarts_total", "counter", "Rounds of the run ended by a failure",
         [](const Run& r) { return r.restarts; });
  perRun("fsdprun_rendezvous_agents", "gauge", "Agents in the round that runs",
         [](const Run& r) { return r.members; });
  perRun("fsdprun_rendezvous_waiting_agents", "gauge", "Agents waiting to join a round (spares included)",
         [](const Run& r) { return r.waiting; });
  perRun("fsdprun_rendezvous_sessions", "gauge", "Store clients of the run (agents, workers through proxies)",
         [](const Run& r) { return r.sessions; });
  perRun("fsdprun_store_keys", "gauge", "Keys in the run's store", [](const Run& r) { return r.keys; });
  perRun("fsdprun_store_key_bytes", "gauge", "Bytes of keys and values in the run's store",
         [](const Run& r) { return r.keyBytes; });
  const auto one = [&](const char* name, const char* type, const char* help, double value) {
    out.family(name, type, help);
    out.sample({}, value);
  };
  one("fsdprun_store_requests_total", "counter", "Store and rendezvous requests served (rate() gives the request rate)",
      static_cast<double>(s.requestsServed));
  one("fsdprun_rendezvous_connections", "gauge", "TCP connections open", static_cast<double>(s.connectionsOpen));
  one("fsdprun_rendezvous_connections_total", "counter", "TCP connections accepted",
      static_cast<double>(s.connectionsAccepted));
  one("fsdprun_rendezvous_queued_bytes", "gauge", "Replies and events not yet written to their sockets",
      static_cast<double>(s.queuedBytes));
  one("fsdprun_rendezvous_queued_bytes_peak", "gauge", "The most bytes ever queued at once",
      static_cast<double>(s.queuedBytesPeak));
  one("fsdprun_rendezvous_slow_readers_closed_total", "counter", "Connections closed for not reading their replies",
      static_cast<double>(s.slowReadersClosed));
  one("fsdprun_rendezvous_protocol_errors_total", "counter", "Requests refused as malformed",
      static_cast<double>(s.protocolErrors));
  one("fsdprun_rendezvous_auth_failures_total", "counter", "Clients refused for a wrong token",
      static_cast<double>(s.authFailures));
}

}  // namespace fsdp::rendezvous
