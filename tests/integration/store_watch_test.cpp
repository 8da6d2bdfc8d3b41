// waitForChange through a real fsdprun-rdzv process on loopback.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <future>
#include <latch>
#include <thread>

#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/protocol.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "raw_socket.hpp"
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
  std::latch connected(kWatchers);
  for (int i = 0; i < kWatchers; ++i) {
    watchers.push_back(std::async(std::launch::async, [&] {
      auto c = StoreClient::connect("127.0.0.1", daemon.port());
      connected.count_down();
      return c->waitForChange({"go"}, since, 10s);
    }));
  }
  // Every watcher connected, and given the time to send its WATCH and be parked server side:
  // the write wakes them (one arriving later would be answered at once, with the same change).
  connected.wait();
  std::this_thread::sleep_for(200ms);
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
  // Our client gives up on the HELLO reply alone; on the wire, a WATCH sent without proving
  // the token gets the challenge, then "not authenticated" and the connection closed, never
  // a change.
  namespace rdzv = fsdp::rendezvous;
  auto bytes = rdzv::encodeRequest({.op = rdzv::Op::kHello, .keys = {"job"}});
  const auto watch =
      rdzv::encodeRequest({.op = rdzv::Op::kWatch, .keys = {"k"}, .number = 0, .timeoutMs = 1000});
  bytes.insert(bytes.end(), watch.begin(), watch.end());
  const int fd = fsdp::testing::connectLoopback(daemon.port());
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  const auto readReply = [fd](rdzv::Op expected) {
    const auto header = fsdp::testing::readUpTo(fd, rdzv::kHeaderSize);
    EXPECT_EQ(header.size(), rdzv::kHeaderSize);
    if (header.size() != rdzv::kHeaderSize) return rdzv::Response{};
    const auto h = rdzv::decodeHeader(header, {});
    EXPECT_EQ(h.op, expected);
    return rdzv::decodeResponse(fsdp::testing::readUpTo(fd, h.bodyLength), {});
  };
  EXPECT_EQ(readReply(rdzv::Op::kHello).number, 1) << "the server must ask for the token";
  const auto refused = readReply(rdzv::Op::kWatch);
  EXPECT_EQ(refused.status, rdzv::Status::kError);
  EXPECT_NE(refused.value.find("not authenticated"), std::string::npos) << refused.value;
  EXPECT_TRUE(fsdp::testing::readUpTo(fd, 1).empty()) << "the connection must close";
  ::close(fd);
}

}  // namespace
