// waitForChange through a real fsdprun-rdzv process on loopback.
#include <gtest/gtest.h>

#include <fstream>
#include <future>

#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "rdzv_daemon.hpp"
#include "run_command.hpp"

namespace {

using fsdp::rendezvous::ClientOptions;
using fsdp::rendezvous::KeyChange;
using fsdp::rendezvous::StoreClient;
using fsdp::testing::RdzvDaemon;
using namespace std::chrono_literals;

TEST(StoreWatch, AWatcherFollowsAnotherClientsWritesToTheLastOne) {
  RdzvDaemon daemon;
  const ClientOptions options{.connectTimeout = 10s, .timeout = 10s, .runId = "job"};
  auto watcher = StoreClient::connect("127.0.0.1", daemon.port(), options);
  auto writer = StoreClient::connect("127.0.0.1", daemon.port(), options);
  const std::uint64_t start = watcher->revision();
  // The watcher follows "k" and "done" while the writer races ahead of it.
  auto seen = std::async(std::launch::async, [&] {
    std::vector<KeyChange> changes;
    std::uint64_t since = start;
    while (changes.empty() || changes.back().key != "done") {
      auto change = watcher->waitForChange({"k", "done"}, since, 10s);
      if (!change)
        throw fsdp::TimeoutError("no change within 10 s after revision " + std::to_string(since));
      since = change->revision;
      changes.push_back(std::move(*change));
    }
    return changes;
  });
  constexpr int kWrites = 200;
  for (int i = 0; i < kWrites; ++i) writer->set("k", std::to_string(i));
  writer->remove("k");
  writer->set("done", "1");
  const auto changes = seen.get();
  // Writes may coalesce, but revisions only grow, values only move forward, and the last state
  // of "k" (deleted) is seen before "done".
  ASSERT_GE(changes.size(), 2u);
  int last = -1;
  for (std::size_t i = 0; i + 1 < changes.size(); ++i) {
    EXPECT_EQ(changes[i].key, "k");
    if (i > 0) {
      EXPECT_GT(changes[i].revision, changes[i - 1].revision);
    }
    if (changes[i].value) {
      const int value = std::stoi(*changes[i].value);
      EXPECT_GT(value, last);
      last = value;
    }
  }
  EXPECT_FALSE(changes[changes.size() - 2].value) << "the deletion of k was lost";
  EXPECT_EQ(changes.back().revision, start + kWrites + 2);
}

TEST(StoreWatch, ManyWatchersAreAllWokenByOneWrite) {
  RdzvDaemon daemon;
  constexpr int kWatchers = 50;
  auto writer = StoreClient::connect("127.0.0.1", daemon.port());
  const std::uint64_t since = writer->revision();
  std::vector<std::future<std::optional<KeyChange>>> watchers;
  for (int i = 0; i < kWatchers; ++i) {
    watchers.push_back(std::async(std::launch::async, [&] {
      auto c = StoreClient::connect("127.0.0.1", daemon.port());
      return c->waitForChange({"go"}, since, 10s);
    }));
  }
  // Whether a watcher is parked yet or connects after the write, it sees the same change.
  writer->set("go", "now");
  for (auto& w : watchers) {
    const auto change = w.get();
    ASSERT_TRUE(change);
    EXPECT_EQ(change->value, "now");
    EXPECT_EQ(change->revision, since + 1);
  }
}

TEST(StoreWatch, AJobTokenGuardsWatchesLikeEveryOtherRequest) {
  fsdp::testing::TempDir dir;
  const std::string tokenFile = dir.path() + "/token";
  std::ofstream(tokenFile) << "s3cret\n";
  RdzvDaemon daemon({"--token_file", tokenFile});
  auto member =
      StoreClient::connect("127.0.0.1", daemon.port(), {.runId = "job", .token = "s3cret"});
  member->set("k", "v");
  EXPECT_EQ(member->waitForChange({"k"}, 0, 1s)->value, "v");
  auto stranger = StoreClient::connect("127.0.0.1", daemon.port(), {.runId = "job"});
  EXPECT_THROW(stranger->waitForChange({"k"}, 0, 1s), fsdp::ConfigError);
}

}  // namespace
