// The agent's /metrics (--metrics_port) and fsdprun-rdzv's, scraped over real sockets while a
// real mnist job runs: every worker's figures, the node's and the rendezvous server's; 404 for
// another path, 405 for another method; a client that never reads its reply stalls nothing; a
// port in use or out of range exits 2 naming the flag.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "fsdp/common/process.hpp"
#include "http_client.hpp"
#include "processes.hpp"
#include "raw_socket.hpp"
#include "rdzv_daemon.hpp"
#include "run_command.hpp"

namespace metrics_endpoint {  // its own names in a unity batch
namespace {

namespace fs = std::filesystem;
using fsdp::testing::httpGet;
using fsdp::testing::httpRequest;
using fsdp::testing::metricValue;
using fsdp::testing::readFile;
using fsdp::testing::runCommand;
using fsdp::testing::scrapeUntil;
using fsdp::testing::TempDir;
using namespace std::chrono_literals;

const std::string kBin = FSDP_BIN_DIR;
const std::string kData = "/usr/share/datasets/fashion-mnist";

TEST(MetricsEndpoint, ServesEveryWorkersFiguresTheNodesAndTheRendezvousAndOnlyThat) {
  if (!fs::exists(kData)) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir dir;
  const int port = fsdp::testing::freeLoopbackPort();
  fsdp::SpawnOptions spawn{.argv = {kBin + "/fsdprun", "--nproc_per_node", "2", "--rdzv_id", "metricsjob",
                                    "--metrics_port", std::to_string(port), "--metrics_addr", "127.0.0.1",
                                    kBin + "/mnist", "--model", "shallow", "--max_steps", "150", "--batch_size", "64", "--no_eval",
                                    "--progress", "lines", "--log_every", "0"},
                           .env = fsdp::currentEnvironment()};
  spawn.stdoutPath = dir.path() + "/out";
  spawn.stderrPath = dir.path() + "/err";
  auto job = fsdp::ChildProcess::spawn(spawn);
  const auto output = [&] { return "--- stdout:\n" + readFile(dir.path() + "/out") + "--- stderr:\n" + readFile(dir.path() + "/err"); };

  // A client that asks and never reads: the endpoint and the job go on without it.
  const int stalled = fsdp::testing::connectLoopback(static_cast<std::uint16_t>(port), 5s, 4096);

  const auto page = scrapeUntil(port, job, 120s, [](const std::string& p) {
    return metricValue(p, "fsdprun_worker_step", {"rank=\"0\""}) >= 20 &&
           metricValue(p, "fsdprun_worker_step", {"rank=\"1\""}) >= 20;
  });
  ASSERT_GE(metricValue(page, "fsdprun_worker_step", {"rank=\"1\""}), 20) << page << output();
  // The reports of steps 1-20 have reached every rank's ring by step 40 or so.
  const auto scored = scrapeUntil(port, job, 120s, [](const std::string& p) {
    return metricValue(p, "fsdprun_worker_straggler_score", {"rank=\"1\""}) > 0;
  });
  EXPECT_GT(metricValue(scored, "fsdprun_worker_straggler_score", {"rank=\"1\""}), 0.3) << scored;
  EXPECT_LT(metricValue(scored, "fsdprun_worker_straggler_score", {"rank=\"1\""}), 3) << scored;
  if (stalled >= 0) {
    const std::string request = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
    EXPECT_EQ(::send(stalled, request.data(), request.size(), MSG_NOSIGNAL), static_cast<ssize_t>(request.size()));
  }
  for (const char* rank : {"rank=\"0\"", "rank=\"1\""}) {
    const std::vector<std::string> labels = {"job=\"metricsjob\"", rank};
    EXPECT_EQ(metricValue(page, "fsdprun_worker_up", labels), 1) << page;
    EXPECT_GT(metricValue(page, "fsdprun_worker_last_step_seconds", {rank, "part=\"total\""}), 0) << page;
    EXPECT_GE(metricValue(page, "fsdprun_worker_last_step_seconds", {rank, "part=\"compute\""}), 0) << page;
    EXPECT_GE(metricValue(page, "fsdprun_worker_last_step_seconds", {rank, "part=\"collective_wait\""}), 0) << page;
    EXPECT_GT(metricValue(page, "fsdprun_worker_samples_per_second", labels), 0) << page;
    EXPECT_GT(metricValue(page, "fsdprun_worker_loss", labels), 0) << page;
    EXPECT_GT(metricValue(page, "fsdprun_worker_collective_bytes_total", labels), 0) << page;
    EXPECT_GT(metricValue(page, "fsdprun_worker_resident_memory_bytes", labels), 1e6) << page;
  }
  EXPECT_EQ(metricValue(page, "fsdprun_node_restarts_total", {"job=\"metricsjob\""}), 0) << page;
  EXPECT_EQ(metricValue(page, "fsdprun_node_workers", {"state=\"running\""}), 2) << page;
  EXPECT_EQ(metricValue(page, "fsdprun_node_hang_watchdog", {"state=\"watching\""}), 1) << page;
  // This agent serves the rendezvous: the server's figures are on the same page.
  EXPECT_EQ(metricValue(page, "fsdprun_rendezvous_rounds_total", {"job=\"metricsjob\""}), 1) << page;
  EXPECT_EQ(metricValue(page, "fsdprun_rendezvous_agents", {"job=\"metricsjob\""}), 1) << page;
  EXPECT_GT(metricValue(page, "fsdprun_store_requests_total"), 0) << page;
  EXPECT_NE(page.find("# TYPE fsdprun_node_restarts_total counter"), std::string::npos) << page;

  // Read-only, and nothing but /metrics.
  const auto reply = httpGet("127.0.0.1", port, "/metrics");
  EXPECT_EQ(reply.status, 200) << reply.error;
  EXPECT_NE(reply.headers.at("content-type").find("text/plain; version=0.0.4"), std::string::npos);
  EXPECT_EQ(httpGet("127.0.0.1", port, "/").status, 404);
  EXPECT_EQ(httpGet("127.0.0.1", port, "/metrics/../admin").status, 404);
  EXPECT_EQ(httpRequest("127.0.0.1", port, "POST", "/metrics").status, 405);
  EXPECT_EQ(httpRequest("127.0.0.1", port, "DELETE", "/metrics").status, 405);

  const auto status = job.waitFor(180s);
  ASSERT_TRUE(status.has_value()) << output();
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << output();
  // The run's summary of the straggler reports (every 20 steps by default).
  EXPECT_NE(readFile(dir.path() + "/out").find("named at 1.5x the median compute, every 20 steps"), std::string::npos)
      << output();
  if (stalled >= 0) ::close(stalled);
}

TEST(MetricsEndpoint, APortInUseOrOutOfRangeExitsTwoNamingTheFlag) {
  const fsdp::testing::SilentListener holder;
  auto r = runCommand({kBin + "/fsdprun", "--metrics_port", std::to_string(holder.port()), "--metrics_addr",
                       "127.0.0.1", "/bin/true"},
                      60s);
  EXPECT_EQ(r.exitCode, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("--metrics_port " + std::to_string(holder.port())), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("in use"), std::string::npos) << r.err;
  r = runCommand({kBin + "/fsdprun", "--metrics_port", "70000", "/bin/true"}, 60s);
  EXPECT_EQ(r.exitCode, 2) << r.err;
  EXPECT_NE(r.err.find("--metrics_port '70000'"), std::string::npos) << r.err;
  r = runCommand({kBin + "/fsdprun-rdzv", "--port", "0", "--metrics_port", std::to_string(holder.port()),
                  "--metrics_addr", "127.0.0.1"},
                 60s);
  EXPECT_EQ(r.exitCode, 2) << r.err;
  EXPECT_NE(r.err.find("--metrics_port " + std::to_string(holder.port())), std::string::npos) << r.err;
}

TEST(MetricsEndpoint, TheStandaloneRendezvousServerServesItsFigures) {
  TempDir dir;
  const int port = fsdp::testing::freeLoopbackPort();
  fsdp::SpawnOptions spawn{.argv = {kBin + "/fsdprun-rdzv", "--port", "0", "--metrics_port", std::to_string(port),
                                    "--metrics_addr", "127.0.0.1"},
                           .env = fsdp::currentEnvironment()};
  spawn.stdoutPath = dir.path() + "/out";
  spawn.stderrPath = dir.path() + "/err";
  auto daemon = fsdp::ChildProcess::spawn(spawn);
  const auto page = scrapeUntil(port, daemon, 30s, [](const std::string& p) {
    return !std::isnan(metricValue(p, "fsdprun_store_requests_total"));
  });
  EXPECT_EQ(metricValue(page, "fsdprun_rendezvous_connections"), 0) << page << readFile(dir.path() + "/err");
  EXPECT_NE(readFile(dir.path() + "/out").find("metrics at http://127.0.0.1:" + std::to_string(port) + "/metrics"),
            std::string::npos);
  ::kill(daemon.pid(), SIGTERM);
  const auto status = daemon.waitFor(30s);
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
}

}  // namespace
}  // namespace metrics_endpoint
