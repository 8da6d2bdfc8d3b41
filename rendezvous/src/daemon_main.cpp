// fsdprun-rdzv: the standalone rendezvous and store daemon. Serves until SIGTERM or SIGINT,
// then stops accepting, tells its clients, and exits 0.
//   fsdprun-rdzv --host 0.0.0.0 --port 29400 --token_file /run/job.token
#include <signal.h>

#include <memory>

#include <CLI/CLI.hpp>
#include <fstream>
#include <iostream>
#include <sstream>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/common/metrics_http.hpp"
#include "fsdp/rendezvous/server_metrics.hpp"
#include "fsdp/rendezvous/store_server.hpp"

namespace {

std::string readToken(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw fsdp::ConfigError("--token_file '" + path + "': cannot read it");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string token = ss.str();
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r')) token.pop_back();
  if (token.empty()) throw fsdp::ConfigError("--token_file '" + path + "': the file is empty");
  return token;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::log::setup({.role = "fsdprun-rdzv"});
  CLI::App app{"fsdprun-rdzv: rendezvous and key-value store for fsdprun jobs", "fsdprun-rdzv"};
  std::string host = "127.0.0.1";
  int port = 29400;
  std::string tokenFile;
  std::size_t maxConnections = 0;
  bool allowPytorch = false;
  double idleTtl = 600;
  std::size_t maxQueued = fsdp::rendezvous::ServerOptions{}.maxQueuedBytes;
  std::size_t maxQueuedTotal = fsdp::rendezvous::ServerOptions{}.maxQueuedBytesTotal;
  app.add_option("--host", host, "Address to listen on (0.0.0.0 or :: for every interface)");
  app.add_option("--port", port, "TCP port (0 = a free one, printed on start)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--token_file,--token-file", tokenFile,
                 "Job token; every client must prove it (default: $FSDPRUN_TOKEN_FILE, else none)");
  app.add_option("--max_connections,--max-connections", maxConnections,
                 "Close connections beyond this many (0 = no limit)");
  app.add_flag("--allow_pytorch_clients,--allow-pytorch-clients", allowPytorch,
               "Serve PyTorch TCPStore clients (who cannot authenticate) even with a token");
  app.add_option("--run_idle_ttl,--run-idle-ttl", idleTtl,
                 "Seconds after which an idle run's keys are dropped")
      ->check(CLI::PositiveNumber);
  app.add_option("--max_queued_bytes,--max-queued-bytes", maxQueued,
                 "Bytes a connection may leave unread before the server stops reading it "
                 "(0 = no limit)");
  int metricsPort = -1;
  std::string metricsAddr = "0.0.0.0";
  app.add_option("--metrics_port,--metrics-port", metricsPort,
                 "Serve Prometheus metrics at http://ADDR:PORT/metrics (read-only): rounds, agents, "
                 "sessions, keys, queued bytes, requests (0 = a free port, printed on start)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--metrics_addr,--metrics-addr", metricsAddr, "Address the metrics endpoint binds (default 0.0.0.0)");
  app.add_option("--max_queued_bytes_total,--max-queued-bytes-total", maxQueuedTotal,
                 "Bytes left unread over all connections before only those with nothing unread "
                 "are read (0 = no limit)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (tokenFile.empty()) {
      if (const char* env = std::getenv("FSDPRUN_TOKEN_FILE")) tokenFile = env;
    }
    fsdp::rendezvous::ServerOptions options{
        .host = host,
        .port = static_cast<std::uint16_t>(port),
        .token = tokenFile.empty() ? std::string() : readToken(tokenFile),
        .maxQueuedBytes = maxQueued,
        .maxQueuedBytesTotal = maxQueuedTotal,
        .maxConnections = maxConnections,
        .runIdleTtl = std::chrono::milliseconds(static_cast<long long>(idleTtl * 1000))};
    if (allowPytorch) options.allowPytorchClients = true;
    // Block the stop signals before the server thread starts, then wait for one here.
    sigset_t stopSignals;
    sigemptyset(&stopSignals);
    sigaddset(&stopSignals, SIGTERM);
    sigaddset(&stopSignals, SIGINT);
    ::pthread_sigmask(SIG_BLOCK, &stopSignals, nullptr);
    // A store for thousands of ranks holds thousands of connections; before the server
    // starts, which sizes its descriptor table by the limit.
    fsdp::raiseDescriptorLimit();
    fsdp::rendezvous::StoreServer server(options);
    std::cout << "fsdprun-rdzv: listening on " << host << ":" << server.port()
              << (options.token.empty() ? " (no token)" : " (token required)") << std::endl;
    std::unique_ptr<fsdp::MetricsHttpServer> metrics;
    if (metricsPort >= 0) {
      try {
        metrics = std::make_unique<fsdp::MetricsHttpServer>(metricsAddr, metricsPort, [&server] {
          fsdp::prom::TextWriter out;
          fsdp::rendezvous::writeServerMetrics(out, server.stats());
          return out.take();
        });
      } catch (const fsdp::Error& e) {
        throw fsdp::ConfigError("--metrics_port " + std::to_string(metricsPort) + ": " + e.what());
      }
      std::cout << "fsdprun-rdzv: metrics at " << metrics->url() << std::endl;
    }
    int sig = 0;
    ::sigwait(&stopSignals, &sig);
    fsdp::log::info("received {}: stopping", sig == SIGTERM ? "SIGTERM" : "SIGINT");
    metrics.reset();  // its scrapes read the server
    server.stop();
    return 0;
  } catch (const fsdp::ConfigError& e) {
    std::cerr << "fsdprun-rdzv: error: " << e.what() << std::endl;
    return 2;
  } catch (const fsdp::NetworkError& e) {
    std::cerr << "fsdprun-rdzv: error: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "fsdprun-rdzv: error: " << e.what() << std::endl;
    return 1;
  }
}
