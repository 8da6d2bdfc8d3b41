// The store server and client over real loopback sockets, port 0 read back.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <future>
#include <thread>

#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "raw_socket.hpp"

namespace fsdp::rendezvous {
namespace {

using namespace std::chrono_literals;

class StoreServerTest : public ::testing::Test {
 protected:
  std::unique_ptr<StoreClient> client() {
    return StoreClient::connect("127.0.0.1", server_.port(), {.connectTimeout = 5s, .timeout = 5s});
  }
  // A raw TCP connection for sending malformed bytes.
  int rawSocket() {
    const int fd = fsdp::testing::connectLoopback(server_.port());
    EXPECT_GE(fd, 0);
    return fd;
  }
  StoreServer server_{ServerOptions{.frameTimeout = 500ms}};
};

TEST_F(StoreServerTest, C10dOperations) {
  auto c = client();
  c->set("a", "1");
  EXPECT_EQ(c->get("a"), "1");
  EXPECT_EQ(c->add("n", 5), 5);
  EXPECT_EQ(c->add("n", -2), 3);
  EXPECT_TRUE(c->check({"a", "n"}));
  EXPECT_FALSE(c->check({"a", "missing"}));
  EXPECT_EQ(c->compareSet("a", "1", "2"), "2");
  EXPECT_EQ(c->numKeys(), 2);
  EXPECT_TRUE(c->remove("a"));
  EXPECT_FALSE(c->remove("a"));
  EXPECT_EQ(c->append("log", "x"), 1);
  c->multiSet({"m1", "m2"}, {"v1", "v2"});
  EXPECT_EQ(c->multiGet({"m1", "m2"}), std::vector<std::string>({"v1", "v2"}));
  EXPECT_THROW(c->multiGet({"m1", "nope"}), Error);
  c->ping();
}

TEST_F(StoreServerTest, GetWaitsServerSideUntilAnotherClientSetsTheKey) {
  auto waiter = client();
  auto setter = client();
  auto result = std::async(std::launch::async, [&] { return waiter->get("late", 5000ms); });
  EXPECT_EQ(result.wait_for(100ms), std::future_status::timeout);
  setter->set("late", "here");
  EXPECT_EQ(result.get(), "here");
}

TEST_F(StoreServerTest, WaitTimeoutNamesTheMissingKeys) {
  auto c = client();
  c->set("present", "1");
  try {
    c->wait({"present", "absent1", "absent2"}, 100ms);
    FAIL();
  } catch (const TimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("absent1, absent2"), std::string::npos) << what;
    EXPECT_EQ(what.find("present,"), std::string::npos) << what;
    EXPECT_NE(what.find("100 ms"), std::string::npos) << what;
  }
  EXPECT_THROW(c->get("absent1", 50ms), TimeoutError);
  c->ping();  // the connection is still good after timeouts
}

TEST_F(StoreServerTest, MalformedFramesCloseOnlyThatConnection) {
  auto good = client();
  good->set("k", "v");
  const std::vector<std::vector<std::uint8_t>> attacks = {
      {0xde, 0xad, 0xbe, 0xef, 1, 1, 0, 0, 0, 0, 0, 0},           // bad magic
      {0x46, 0x53, 0x44, 0x50, 1, 1, 0, 0, 0xff, 0xff, 0xff, 0x7f},  // 2 GiB body
      {0x46, 0x53, 0x44, 0x50, 1, 1, 0, 0, 8, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0},
  };
  for (const auto& bytes : attacks) {
    const int fd = rawSocket();
    ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    char buf[16];
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    // Closed (EOF) or reset (the server closed with our bytes unread): either way, gone.
    EXPECT_LE(::read(fd, buf, sizeof(buf)), 0) << "server must close the bad connection";
    ::close(fd);
    EXPECT_EQ(good->get("k"), "v");
  }
  EXPECT_GE(server_.stats().protocolErrors, 3u);
}

TEST_F(StoreServerTest, AStalledFrameIsDroppedAfterTheFrameTimeout) {
  auto good = client();
  const int fd = rawSocket();
  const std::uint8_t partial[] = {0x46, 0x53};  // two bytes of a header, then silence
  ASSERT_EQ(::write(fd, partial, sizeof(partial)), 2);
  char buf[4];
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(::read(fd, buf, sizeof(buf)), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  ::close(fd);
  good->ping();
}

TEST_F(StoreServerTest, ManyConcurrentClientsCountExactly) {
  constexpr int kClients = 32;
  constexpr int kAdds = 50;
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([this] {
      auto c = client();
      for (int j = 0; j < kAdds; ++j) c->add("counter", 1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(client()->add("counter", 0), kClients * kAdds);
}

TEST(StoreServerToken, OnlyClientsWithTheTokenGetIn) {
  StoreServer server(ServerOptions{.token = "s3cret"});
  auto good = StoreClient::connect("127.0.0.1", server.port(), {.runId = "job", .token = "s3cret"});
  good->set("k", "v");
  try {
    StoreClient::connect("127.0.0.1", server.port(), {.runId = "job", .token = "wrong"});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("authentication failed"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("s3cret"), std::string::npos);
  }
  // Without a token the refusal comes with the first request (HELLO is pipelined with it).
  EXPECT_THROW(StoreClient::connect("127.0.0.1", server.port(), {.runId = "job"})->get("k"), ConfigError);
  EXPECT_EQ(good->get("k"), "v");
  EXPECT_EQ(server.stats().authFailures, 2u);  // the wrong token, the missing one
}

TEST(StoreServerRuns, EachRunHasItsOwnKeys) {
  StoreServer server(ServerOptions{});
  auto a = StoreClient::connect("127.0.0.1", server.port(), {.runId = "a"});
  auto b = StoreClient::connect("127.0.0.1", server.port(), {.runId = "b"});
  a->set("k", "from a");
  EXPECT_FALSE(b->check({"k"}));
  EXPECT_EQ(b->numKeys(), 0);
  EXPECT_EQ(a->get("k"), "from a");
}

TEST(StoreServerRuns, AnIdleRunIsDroppedAfterItsTtl) {
  // A TTL long enough that no pause of a loaded host between the set and the first count drops the
  // run before it is counted.
  StoreServer server(ServerOptions{.runIdleTtl = 1000ms});
  {
    auto a = StoreClient::connect("127.0.0.1", server.port(), {.runId = "a"});
    a->set("k", "v");
  }
  EXPECT_EQ(server.stats().runs, 1u);
  // The sweep runs every ttl/4 (at least 100 ms): bounded by a few sweeps. Asking through a
  // client would keep the run alive, so this watches the server's own count.
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (server.stats().runs != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ(server.stats().runs, 0u);
  EXPECT_EQ(StoreClient::connect("127.0.0.1", server.port(), {.runId = "a"})->numKeys(), 0);
}

TEST(StoreServerRuns, ARunOverItsByteLimitLosesThatConnectionOnly) {
  ServerOptions options;
  options.limits.maxRunBytes = 1000;
  StoreServer server(options);
  auto other = StoreClient::connect("127.0.0.1", server.port(), {.runId = "a"});
  auto greedy = StoreClient::connect("127.0.0.1", server.port(), {.runId = "a"});
  greedy->set("small", "x");
  EXPECT_THROW(greedy->set("big", std::string(2000, 'x')), Error);
  EXPECT_EQ(other->get("small"), "x");
}

TEST(StoreClientConnect, GivesUpAfterItsTimeoutNamingTheEndpoint) {
  // A port that was free a moment ago: nothing listens there.
  std::uint16_t port = 0;
  {
    StoreServer probe(ServerOptions{});
    port = probe.port();
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    StoreClient::connect("127.0.0.1", port, {.connectTimeout = 300ms});
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(port)), std::string::npos);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
}

TEST(StoreServerBind, ABusyPortIsANetworkErrorNamingIt) {
  StoreServer first(ServerOptions{});
  try {
    StoreServer second(ServerOptions{.port = first.port()});
    FAIL();
  } catch (const NetworkError& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(first.port())), std::string::npos);
  }
}

}  // namespace
}  // namespace fsdp::rendezvous

namespace fsdp::rendezvous {
namespace {

TEST(StoreAddAndWait, EveryRankIsReleasedWhenTheLastArrives) {
  StoreServer server(ServerOptions{});
  constexpr int kRanks = 8;
  std::vector<std::future<std::int64_t>> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.push_back(std::async(std::launch::async, [&] {
      auto c = StoreClient::connect("127.0.0.1", server.port());
      return c->addAndWait("init", 1, kRanks, std::chrono::seconds(10));
    }));
  }
  for (auto& r : ranks) EXPECT_GE(r.get(), kRanks);
}

TEST(StoreAddAndWait, TimeoutSaysHowFarTheCounterGot) {
  StoreServer server(ServerOptions{});
  auto c = StoreClient::connect("127.0.0.1", server.port());
  c->add("init", 2);
  try {
    c->addAndWait("init", 1, 5, std::chrono::milliseconds(100));
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("[init] at 3 of 5"), std::string::npos) << e.what();
  }
  // The timed-out waiter is gone: a later arrival does not touch a dead session.
  EXPECT_EQ(c->addAndWait("init", 2, 5, std::chrono::seconds(1)), 5);
}

}  // namespace
}  // namespace fsdp::rendezvous

namespace fsdp::rendezvous {
namespace {

using namespace std::chrono_literals;

// A wait check (the runtime's, under --restart_mode auto): waits go to the server in slices with
// the check before each, and are the same waits: a key set later is still returned, and
// addAndWait adds once however many slices it took.
TEST(StoreWaitCheck, SlicedWaitsReturnWhatOneWaitReturnsAndAddOnce) {
  StoreServer server(ServerOptions{});
  auto waiter = StoreClient::connect("127.0.0.1", server.port());
  auto other = StoreClient::connect("127.0.0.1", server.port());
  std::atomic<int> checks{0};
  std::promise<void> sliced;
  waiter->setWaitCheck(
      [&] {
        if (++checks == 3) sliced.set_value();
      },
      10ms);
  auto value = std::async(std::launch::async, [&] { return waiter->get("late", 30s); });
  sliced.get_future().wait();  // three slices asked: the key is not there yet
  other->set("late", "here");
  ASSERT_EQ(value.wait_for(10s), std::future_status::ready);
  EXPECT_EQ(value.get(), "here");

  const int before = checks.load();
  auto counted = std::async(std::launch::async, [&] { return waiter->addAndWait("arrivals", 1, 2, 30s); });
  while (checks.load() < before + 3) std::this_thread::yield();  // several slices of the wait
  EXPECT_EQ(other->addAndWait("arrivals", 1, 2, 30s), 2);
  ASSERT_EQ(counted.wait_for(10s), std::future_status::ready);
  EXPECT_EQ(counted.get(), 2);
  EXPECT_EQ(other->add("arrivals", 0), 2) << "a slice after the first added again";
}

// What the check throws ends a wait long before its timeout, with the check's own error.
TEST(StoreWaitCheck, WhatTheCheckThrowsEndsTheWait) {
  StoreServer server(ServerOptions{});
  auto c = StoreClient::connect("127.0.0.1", server.port());
  std::atomic<bool> aborted{false};
  std::atomic<int> checks{0};
  c->setWaitCheck(
      [&] {
        ++checks;
        if (aborted) throw CommAborted("the world re-forms");
      },
      20ms);
  auto wait = std::async(std::launch::async, [&] { c->wait({"never"}, 60s); });
  while (checks.load() < 2) std::this_thread::yield();  // waiting
  aborted = true;
  ASSERT_EQ(wait.wait_for(10s), std::future_status::ready);
  EXPECT_THROW(wait.get(), CommAborted);
  // Set again (the re-formation began): waits work as before on the same connection.
  aborted = false;
  c->set("k", "v");
  EXPECT_EQ(c->get("k", 1s), "v");
}

// reconnect(): the same object (a program's reference to it stays good) now talks to another
// server; a reconnection that fails keeps the old connection.
TEST(StoreReconnect, TheSameObjectGoesOnAtTheNewServerAndAFailedOneKeepsTheOld) {
  StoreServer first(ServerOptions{});
  StoreServer second(ServerOptions{});
  auto client = StoreClient::connect("127.0.0.1", first.port());
  StoreClient& held = *client;
  held.set("where", "first");
  held.reconnect("127.0.0.1", second.port(), {.connectTimeout = 5s, .timeout = 5s});
  EXPECT_EQ(held.endpoint(), "127.0.0.1:" + std::to_string(second.port()));
  held.set("where", "second");
  EXPECT_EQ(StoreClient::connect("127.0.0.1", second.port())->get("where", 1s), "second");
  EXPECT_EQ(StoreClient::connect("127.0.0.1", first.port())->get("where", 1s), "first");
  std::uint16_t closed = 0;
  {
    StoreServer gone(ServerOptions{});
    closed = gone.port();
  }
  EXPECT_THROW(held.reconnect("127.0.0.1", closed, {.connectTimeout = 200ms, .timeout = 1s}), Error);
  EXPECT_EQ(held.get("where", 1s), "second");
  EXPECT_EQ(held.endpoint(), "127.0.0.1:" + std::to_string(second.port()));
}

}  // namespace
}  // namespace fsdp::rendezvous
