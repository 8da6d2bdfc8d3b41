// The node's store proxy: many local clients on one multiplexed connection to a real server,
// on loopback.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <random>
#include <thread>

#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/protocol.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/rendezvous/store_proxy.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "raw_socket.hpp"

namespace {

using namespace fsdp::rendezvous;
using fsdp::testing::closedWithin;
using fsdp::testing::connectLoopback;
using fsdp::testing::readUpTo;
using namespace std::chrono_literals;

constexpr const char* kToken = "proxy-test-token";

// Polls `stat` until it equals `want` (the server or proxy updates it on its own thread).
template <typename F>
bool eventually(F stat, std::uint64_t want) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (static_cast<std::uint64_t>(stat()) != want) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

struct Node {
  explicit Node(StoreServer& server, std::string token = kToken)
      : proxy({.serverHost = "127.0.0.1", .serverPort = server.port(), .runId = "job", .token = std::move(token)}) {}
  std::unique_ptr<StoreClient> client(const std::string& token = kToken) {
    return StoreClient::connect("127.0.0.1", proxy.port(),
                                {.connectTimeout = 5s, .timeout = 10s, .runId = "job", .token = token});
  }
  StoreProxy proxy;
};

TEST(StoreProxy, EveryStoreOperationThroughOneServerConnection) {
  StoreServer server({.token = kToken});
  Node node(server);
  static constexpr int kClients = 32;
  std::vector<std::future<void>> ranks;
  for (int i = 0; i < kClients; ++i) {
    ranks.push_back(std::async(std::launch::async, [&node, i] {
      auto store = node.client();
      const std::string me = std::to_string(i);
      store->set("k" + me, "v" + me);
      EXPECT_EQ(store->get("k" + me), "v" + me);
      EXPECT_EQ(store->compareSet("k" + me, "v" + me, "w" + me), "w" + me);
      store->append("k" + me, "!");
      EXPECT_EQ(store->get("k" + me), "w" + me + "!");
      store->add("count", 1);
      EXPECT_TRUE(store->check({"k" + me}));
      // Everyone waits for everyone: blocking requests of many streams at once.
      store->set("here/" + me, "1");
      std::vector<std::string> all;
      for (int j = 0; j < kClients; ++j) all.push_back("here/" + std::to_string(j));
      store->wait(all, 10s);
      EXPECT_EQ(store->addAndWait("barrier", 1, kClients, 10s), kClients);
      EXPECT_TRUE(store->remove("k" + me));
      EXPECT_FALSE(store->check({"k" + me}));
    }));
  }
  for (auto& r : ranks) r.get();
  auto store = node.client();
  EXPECT_EQ(store->add("count", 0), kClients);
  EXPECT_EQ(store->numKeys(), kClients + 2);  // here/*, count, barrier
  const auto stats = server.stats();
  EXPECT_EQ(stats.connectionsOpen, 1u) << "the proxy's connection only";
  EXPECT_EQ(stats.connectionsAccepted, 1u);
  EXPECT_GE(stats.streamsOpen, 1u);
  store.reset();
  EXPECT_TRUE(eventually([&] { return server.stats().streamsOpen; }, 0)) << "closed clients leave their streams";
  EXPECT_TRUE(eventually([&] { return node.proxy.stats().clientsOpen; }, 0));
}

TEST(StoreProxy, AWaitingClientHoldsUpNoOther) {
  StoreServer server({.token = kToken});
  Node node(server);
  auto waiter = node.client();
  auto late = std::async(std::launch::async, [&] { return waiter->get("late", 10s); });
  auto busy = node.client();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 200; ++i) busy->set("n", std::to_string(i));
  EXPECT_EQ(busy->get("n"), "199");
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_EQ(late.wait_for(0ms), std::future_status::timeout) << "the waiter must still wait";
  busy->set("late", "here");
  EXPECT_EQ(late.get(), "here");
}

// Sends HELLO (no token) and `request` on a raw connection to the proxy.
int rawClient(std::uint16_t port, const Request& request) {
  const int fd = connectLoopback(port, 500ms);
  auto bytes = encodeRequest({.op = Op::kHello, .keys = {"job"}});
  const auto more = encodeRequest(request);
  bytes.insert(bytes.end(), more.begin(), more.end());
  ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  return fd;
}

TEST(StoreProxy, AClientThatLeavesWhileWaitingEndsItsStreamOnly) {
  StoreServer server({});
  Node node(server, "");
  auto stays = node.client("");
  stays->set("here", "1");  // its HELLO leaves with its first request
  const int leaves = rawClient(node.proxy.port(), {.op = Op::kWait, .keys = {"never"}, .timeoutMs = 60000});
  ASSERT_TRUE(eventually([&] { return server.stats().streamsOpen; }, 2));
  ::close(leaves);  // the client goes away mid-wait
  EXPECT_TRUE(eventually([&] { return server.stats().streamsOpen; }, 1));
  stays->set("still", "works");
  EXPECT_EQ(stays->get("still"), "works");
  // Its stream number was freed by the server's END_STREAM; new clients keep coming.
  for (int i = 0; i < 200; ++i) node.client("")->set("again", std::to_string(i));
  EXPECT_EQ(stays->get("again"), "199");
  EXPECT_TRUE(eventually([&] { return server.stats().streamsOpen; }, 1));
}

TEST(StoreProxy, AStreamCannotJoinARendezvous) {
  StoreServer server({});
  Node node(server, "");
  // JOIN's events go to a connection, and its close is the agent's leaving: an agent joins on
  // a connection of its own, never through a proxy.
  const int fd = rawClient(node.proxy.port(), {.op = Op::kJoin, .value = "{}"});
  const auto reply = readUpTo(fd, 2 * kHeaderSize + 120);
  ::close(fd);
  const std::string text(reply.begin(), reply.end());
  EXPECT_NE(text.find("is not multiplexed"), std::string::npos) << text;
  auto client = node.client("");
  client->set("still", "here");
  EXPECT_EQ(client->get("still"), "here");
}

TEST(StoreProxy, EveryClientProvesTheTokenItself) {
  StoreServer server({.token = kToken});
  Node node(server);
  auto good = node.client();
  try {
    node.client("not-the-token")->set("x", "y");
    FAIL() << "a client with a wrong token got through the proxy";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("authentication failed"), std::string::npos) << e.what();
  }
  EXPECT_EQ(server.stats().authFailures, 1u);
  good->set("x", "fine");
  EXPECT_EQ(node.client()->get("x"), "fine");
  EXPECT_TRUE(node.proxy.stats().serverConnected);
  // A proxy without the token is refused by the server before it can carry anyone.
  EXPECT_THROW(Node(server, "wrong"), fsdp::Error);
}

TEST(StoreProxy, GarbageFromOneClientClosesThatClientOnly) {
  StoreServer server({.token = kToken});
  Node node(server);
  auto good = node.client();
  std::mt19937 rng(7);
  for (int round = 0; round < 20; ++round) {
    const int fd = connectLoopback(node.proxy.port());
    ASSERT_GE(fd, 0);
    std::vector<std::uint8_t> junk(1 + rng() % 300);
    for (auto& b : junk) b = static_cast<std::uint8_t>(rng());
    junk[0] = static_cast<std::uint8_t>(rng() % 2 == 0 ? 'F' : junk[0]);
    ::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
    ::shutdown(fd, SHUT_WR);
    readUpTo(fd, 1 << 16);  // whatever comes, the proxy closes it
    ::close(fd);
    good->set("alive", std::to_string(round));
  }
  {
    // A good header with a broken body: the proxy forwards it; the server ends that stream.
    const int fd = connectLoopback(node.proxy.port());
    auto hello = encodeRequest({.op = Op::kHello, .keys = {"job"}});
    auto bad = encodeRequest({.op = Op::kSet, .keys = {"k"}, .value = "v"});
    bad.resize(bad.size() - 3);
    bad[8] = static_cast<std::uint8_t>(bad.size() - kHeaderSize);  // a body that ends early
    hello.insert(hello.end(), bad.begin(), bad.end());
    ::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL);
    const auto reply = readUpTo(fd, 1 << 16);  // the HELLO reply (a challenge), then the close
    EXPECT_GE(reply.size(), kHeaderSize);
    ::close(fd);
  }
  // A first frame that is not a well-formed HELLO: the server would never open that stream,
  // so the proxy closes the client at once instead of leaving it to wait.
  const auto protocolErrors = node.proxy.stats().protocolErrors;
  for (const bool malformedHello : {true, false}) {
    const int fd = connectLoopback(node.proxy.port());
    auto first = malformedHello ? encodeRequest({.op = Op::kHello, .keys = {"job"}})
                                : encodeRequest({.op = Op::kGet, .keys = {"alive"}});
    if (malformedHello) {
      first.resize(first.size() - 2);
      first[8] = static_cast<std::uint8_t>(first.size() - kHeaderSize);
    }
    ::send(fd, first.data(), first.size(), MSG_NOSIGNAL);
    EXPECT_TRUE(closedWithin(fd, 5s)) << (malformedHello ? "malformed HELLO" : "GET before HELLO");
    ::close(fd);
  }
  EXPECT_TRUE(eventually([&] { return node.proxy.stats().protocolErrors; }, protocolErrors + 2));
  EXPECT_GE(server.stats().protocolErrors, 1u);
  EXPECT_GE(node.proxy.stats().protocolErrors, 1u);
  EXPECT_EQ(good->get("alive"), "19");
  EXPECT_TRUE(node.proxy.stats().serverConnected);
  EXPECT_EQ(server.stats().connectionsOpen, 1u);
  // A PyTorch TCPStore client's first bytes are not our frames: refused, named in the log.
  const int fd = connectLoopback(node.proxy.port());
  const std::uint8_t pytorchSet[] = {0, 1, 0, 0, 0, 0, 0, 0, 0, 'k', 1, 0, 0, 0, 0, 0, 0, 0, 'v'};
  ::send(fd, pytorchSet, sizeof(pytorchSet), MSG_NOSIGNAL);
  EXPECT_TRUE(readUpTo(fd, 64).empty());
  ::close(fd);
  // Every closed client's stream number is free again (the ones the server never saw at once,
  // the others on the server's END_STREAM): only the good client's is taken.
  EXPECT_TRUE(eventually([&] { return node.proxy.stats().streamsInUse; }, 1));
}

TEST(StoreProxy, TwoNodesMeetAtOneCounter) {
  StoreServer server({.token = kToken});
  Node a(server);
  Node b(server);
  static constexpr int kPerNode = 40;
  std::vector<std::future<std::int64_t>> ranks;
  for (int i = 0; i < 2 * kPerNode; ++i) {
    Node& node = i % 2 == 0 ? a : b;
    ranks.push_back(std::async(std::launch::async, [&node] {
      return node.client()->addAndWait("init", 1, 2 * kPerNode, 10s);
    }));
  }
  for (auto& r : ranks) EXPECT_EQ(r.get(), 2 * kPerNode);
  EXPECT_EQ(server.stats().connectionsAccepted, 2u);
}

TEST(StoreProxy, LosingTheServerClosesEveryClient) {
  auto server = std::make_unique<StoreServer>(ServerOptions{.token = kToken});
  Node node(*server);
  auto client = node.client();
  client->set("a", "b");
  auto waiting = std::async(std::launch::async, [&] { return client->get("never", 30s); });
  const auto start = std::chrono::steady_clock::now();
  server.reset();
  EXPECT_THROW(waiting.get(), fsdp::Error);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << "a lost server must be noticed at once";
  EXPECT_TRUE(eventually([&] { return node.proxy.stats().serverConnected ? 1 : 0; }, 0));
  EXPECT_ANY_THROW(StoreClient::connect("127.0.0.1", node.proxy.port(),
                                       {.connectTimeout = 200ms, .runId = "job", .token = kToken})
                       ->set("a", "c"));
}

TEST(StoreProxy, AClientOfTheProxyCannotMultiplex) {
  StoreServer server({.token = kToken});
  Node node(server);
  auto client = node.client();
  const int fd = connectLoopback(node.proxy.port());
  auto mux = encodeRequest({.op = Op::kMux});
  ::send(fd, mux.data(), mux.size(), MSG_NOSIGNAL);
  EXPECT_TRUE(readUpTo(fd, 64).empty()) << "a client of the proxy cannot multiplex";
  ::close(fd);
  client->set("still", "here");
  EXPECT_EQ(client->get("still"), "here");
}

}  // namespace

namespace {

// A local client that sends requests and never reads: the proxy stops reading it past its
// bound of unread replies, closes it after the unread timeout, and serves the others
// throughout.
TEST(StoreProxy, AClientThatReadsNoRepliesIsPausedThenClosedAndTheOthersGoOn) {
  StoreServer server({});
  StoreProxy proxy({.serverHost = "127.0.0.1",
                    .serverPort = server.port(),
                    .runId = "job",
                    .maxUnreadBytes = 64u << 10,
                    .unreadTimeout = 300ms});
  auto good = StoreClient::connect("127.0.0.1", proxy.port(), {.timeout = 10s, .runId = "job"});
  good->set("big", std::string(64u << 10, 'v'));
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  const int small = 4096;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(proxy.port());
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  auto bytes = encodeRequest({.op = Op::kHello, .keys = {"job"}});
  for (int i = 0; i < 400; ++i) {  // 25 MiB of replies: more than every buffer on the way
    const auto get = encodeRequest({.op = Op::kGet, .keys = {"big"}, .timeoutMs = 1000});
    bytes.insert(bytes.end(), get.begin(), get.end());
  }
  std::thread sender([&] {
    std::size_t sent = 0;
    while (sent < bytes.size()) {
      const auto n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) break;  // closed by the proxy
      sent += static_cast<std::size_t>(n);
    }
  });
  EXPECT_TRUE(eventually([&] { return proxy.stats().slowReadersClosed; }, 1))
      << "the client that reads nothing is closed";
  sender.join();
  EXPECT_TRUE(closedWithin(fd, 10s));
  ::close(fd);
  good->set("k", "v");
  EXPECT_EQ(good->get("k"), "v");
}

}  // namespace
