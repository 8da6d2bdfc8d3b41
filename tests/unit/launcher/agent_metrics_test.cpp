// The agent's /metrics page from real flight recorder rings and a real rendezvous server: what a
// scrape shows of each worker, of the node and of the server, in the Prometheus text format.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>

#include "fsdp/common/flight_ring.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "http_client.hpp"
#include "metrics/agent_metrics.hpp"

namespace {

using fsdp::launcher::detail::AgentMetrics;
using fsdp::launcher::detail::WatchedWorker;
using fsdp::testing::metricValue;

TEST(AgentMetrics, ShowsEachWorkersRingTheNodeAndTheServer) {
  auto ring = std::make_shared<fsdp::flight::RingMemory>(fsdp::flight::RingMemory::create(64));
  fsdp::flight::Writer writer(*ring);
  writer.attach(5);
  writer.markProgress(41, "trainer step");
  writer.publishTiming({.steps = 41, .stepNs = 4'100'000'000, .waitNs = 1'000'000'000, .dataNs = 100'000'000,
                        .lastStepNs = 200'000'000, .lastWaitNs = 50'000'000, .lastDataNs = 10'000'000,
                        .samples = 41 * 16, .lastSamples = 16, .loss = 0.75, .straggler = 2.5});
  writer.addBytes(123456);
  AgentMetrics metrics("job-a", "node7");
  // This process stands in for the worker (a live pid with a resident set).
  metrics.roundStarted(3, 1, 8, 2, {WatchedWorker{.localRank = 1, .rank = 5, .pid = ::getpid(), .ring = ring}},
                       "watching");
  fsdp::rendezvous::StoreServer server({.host = "127.0.0.1", .port = 0});
  metrics.setServer(&server);
  const std::string page = metrics.render();
  const std::vector<std::string> worker = {"job=\"job-a\"", "node=\"node7\"", "rank=\"5\"", "local_rank=\"1\""};
  EXPECT_EQ(metricValue(page, "fsdprun_worker_step", worker), 41) << page;
  EXPECT_EQ(metricValue(page, "fsdprun_worker_up", worker), 1) << page;
  EXPECT_DOUBLE_EQ(metricValue(page, "fsdprun_worker_last_step_seconds", {"rank=\"5\"", "part=\"total\""}), 0.2);
  EXPECT_DOUBLE_EQ(metricValue(page, "fsdprun_worker_last_step_seconds", {"rank=\"5\"", "part=\"compute\""}), 0.14);
  EXPECT_DOUBLE_EQ(metricValue(page, "fsdprun_worker_last_step_seconds", {"rank=\"5\"", "part=\"collective_wait\""}),
                   0.05);
  EXPECT_DOUBLE_EQ(metricValue(page, "fsdprun_worker_step_seconds_total", {"rank=\"5\"", "part=\"compute\""}), 3.0);
  EXPECT_DOUBLE_EQ(metricValue(page, "fsdprun_worker_samples_per_second", worker), 80);
  EXPECT_DOUBLE_EQ(metricValue(page, "fsdprun_worker_loss", worker), 0.75);
  EXPECT_EQ(metricValue(page, "fsdprun_worker_collective_bytes_total", worker), 123456);
  EXPECT_DOUBLE_EQ(metricValue(page, "fsdprun_worker_straggler_score", worker), 2.5);
  EXPECT_GT(metricValue(page, "fsdprun_worker_resident_memory_bytes", worker), 1e6);
  EXPECT_TRUE(std::isnan(metricValue(page, "fsdprun_worker_tokens_per_second")));  // none reported
  EXPECT_EQ(metricValue(page, "fsdprun_node_restarts_total", {"node=\"node7\""}), 2);
  EXPECT_EQ(metricValue(page, "fsdprun_node_rounds_total"), 1);
  EXPECT_EQ(metricValue(page, "fsdprun_node_world_size"), 8);
  EXPECT_EQ(metricValue(page, "fsdprun_node_workers", {"state=\"running\""}), 1);
  EXPECT_EQ(metricValue(page, "fsdprun_node_hang_watchdog", {"state=\"watching\""}), 1);
  EXPECT_DOUBLE_EQ(metricValue(page, "fsdprun_node_straggler_score"), 2.5);
  EXPECT_EQ(metricValue(page, "fsdprun_rendezvous_connections"), 0) << page;
  EXPECT_FALSE(std::isnan(metricValue(page, "fsdprun_store_requests_total"))) << page;
  // Every family once, typed.
  EXPECT_NE(page.find("# TYPE fsdprun_worker_step gauge\n"), std::string::npos);
  EXPECT_NE(page.find("# TYPE fsdprun_node_restarts_total counter\n"), std::string::npos);

  // The round ends: the workers are down, their last figures stay.
  metrics.hangReported();
  metrics.roundEnded(1);
  metrics.setServer(nullptr);
  const std::string after = metrics.render();
  EXPECT_EQ(metricValue(after, "fsdprun_worker_up", worker), 0) << after;
  EXPECT_EQ(metricValue(after, "fsdprun_worker_step", worker), 41) << after;
  EXPECT_EQ(metricValue(after, "fsdprun_node_workers", {"state=\"failed\""}), 1) << after;
  EXPECT_EQ(metricValue(after, "fsdprun_node_hang_watchdog", {"state=\"reported\""}), 1) << after;
  EXPECT_TRUE(std::isnan(metricValue(after, "fsdprun_store_requests_total"))) << after;
}

TEST(AgentMetrics, AWorkerThatNeverAttachedShowsOnlyWhetherItRuns) {
  auto ring = std::make_shared<fsdp::flight::RingMemory>(fsdp::flight::RingMemory::create(64));
  AgentMetrics metrics("j", "n");
  metrics.roundStarted(0, 0, 1, 0, {WatchedWorker{.localRank = 0, .rank = 0, .pid = ::getpid(), .ring = ring}}, "off");
  const std::string page = metrics.render();
  EXPECT_EQ(metricValue(page, "fsdprun_worker_up", {"rank=\"0\""}), 1) << page;
  EXPECT_TRUE(std::isnan(metricValue(page, "fsdprun_worker_step"))) << page;
  EXPECT_TRUE(std::isnan(metricValue(page, "fsdprun_worker_loss"))) << page;
  EXPECT_EQ(metricValue(page, "fsdprun_node_hang_watchdog", {"state=\"off\""}), 1) << page;
}

}  // namespace
