#pragma once
// The rendezvous server's figures in the Prometheus text format, for fsdprun-rdzv's /metrics and
// the /metrics of the agent that serves the rendezvous (labels: job = the run id).

#include "fsdp/common/prometheus_text.hpp"
#include "fsdp/rendezvous/store_server.hpp"

namespace fsdp::rendezvous {

void writeServerMetrics(prom::TextWriter& out, const ServerStats& stats);

}  // namespace fsdp::rendezvous
