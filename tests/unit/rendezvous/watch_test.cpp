// Change notification: revisions and observers of the KvStore, waitForChange through a real
// server, and PyTorch 1.13's WATCH_KEY on the wire.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <thread>

#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/kv_store.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "raw_socket.hpp"

namespace fsdp::rendezvous {
namespace {

using namespace std::chrono_literals;

TEST(KvStoreRevision, EveryWriteAndDeleteAdvancesItAndNothingElseDoes) {
  KvStore s;
  EXPECT_EQ(s.revision(), 0u);
  s.set("a", "1");
  EXPECT_EQ(s.revision(), 1u);
  s.add("n", 2);
  s.append("a", "x");
  EXPECT_EQ(s.revision(), 3u);
  s.compareSet("a", "wrong", "y");  // no swap, no write
  s.compareSet("absent", "x", "y");
  EXPECT_EQ(s.revision(), 3u);
  s.compareSet("a", "1x", "y");
  EXPECT_EQ(s.revision(), 4u);
  EXPECT_FALSE(s.remove("absent"));
  EXPECT_EQ(s.revision(), 4u);
  EXPECT_TRUE(s.remove("a"));
  EXPECT_EQ(s.revision(), 5u);
  s.get("n");
  s.containsAll({"n"});
  EXPECT_EQ(s.revision(), 5u);
}

TEST(KvStoreRevision, ChangeSinceReportsTheEarliestLastWriteOfTheWatchedKeys) {
  KvStore s;
  s.set("a", "1");  // 1
  s.set("b", "2");  // 2
  s.set("a", "3");  // 3
  s.set("c", "4");  // 4, not watched
  const auto first = s.changeSince({"a", "b"}, 0);
  ASSERT_TRUE(first);
  EXPECT_EQ(first->key, "b");
  EXPECT_EQ(first->value, "2");
  EXPECT_EQ(first->revision, 2u);
  const auto second = s.changeSince({"a", "b"}, 2);
  ASSERT_TRUE(second);
  EXPECT_EQ(second->key, "a");
  EXPECT_EQ(second->value, "3");  // two writes of a: one change, the latest value
  EXPECT_EQ(second->revision, 3u);
  EXPECT_FALSE(s.changeSince({"a", "b"}, 3));
  EXPECT_FALSE(s.changeSince({"never"}, 0));
}

TEST(KvStoreRevision, ADeletedKeyIsReportedDeletedAndARecreatedOneWithItsValue) {
  KvStore s;
  s.set("k", "v");  // 1
  s.remove("k");    // 2
  const auto gone = s.changeSince({"k"}, 1);
  ASSERT_TRUE(gone);
  EXPECT_EQ(gone->key, "k");
  EXPECT_FALSE(gone->value);
  EXPECT_EQ(gone->revision, 2u);
  EXPECT_FALSE(s.changeSince({"k"}, 2));
  s.set("k", "again");  // 3
  const auto back = s.changeSince({"k"}, 1);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->value, "again");
  EXPECT_EQ(back->revision, 3u);
}

TEST(KvStoreRevision, ForgottenDeletionsAreReportedAgainNeverLost) {
  KvStore s;
  s.set("watched", "v");
  const std::uint64_t seen = s.revision();
  s.remove("watched");
  // Enough other deletions to overflow the remembered ones.
  for (std::size_t i = 0; i <= KvStore::kMaxTombstones; ++i) {
    const std::string key = "tmp/" + std::to_string(i);
    s.set(key, "x");
    s.remove(key);
  }
  const auto change = s.changeSince({"watched"}, seen);
  ASSERT_TRUE(change) << "a deletion after `since` must not be lost when it is forgotten";
  EXPECT_FALSE(change->value);
  EXPECT_GT(change->revision, seen);
  // Asked from after the point where deletions were forgotten, nothing is new.
  EXPECT_FALSE(s.changeSince({"watched"}, change->revision));
}

TEST(KvStoreObservers, SeeEveryChangeOfTheirKeyWithOldAndNewValues) {
  KvStore s;
  std::vector<std::string> seen;
  const auto id = s.observe("k", [&](const KeyEvent& e) {
    seen.push_back(std::to_string(static_cast<int>(e.kind)) + ":" + std::string(e.oldValue) + ">" +
                   std::string(e.newValue));
  });
  s.set("k", "1");
  s.add("k", 2);
  s.append("k", "x");
  s.compareSet("k", "nope", "y");
  s.compareSet("k", "3x", "y");
  s.set("other", "1");
  s.remove("k");
  s.set("k/sub", "1");
  s.set("k", "z");
  s.removePrefix("k");
  EXPECT_EQ(seen, std::vector<std::string>(
                      {"0:>1", "1:1>3", "3:3>3x", "1:3x>y", "2:y>", "0:>z", "2:z>"}));
  s.unobserve(id);
  s.set("k", "after");
  EXPECT_EQ(seen.size(), 7u);
  EXPECT_EQ(s.observerCount(), 0u);
}

TEST(KvStore, DeletesWakeOneShotWatchesToo) {
  KvStore s;
  s.set("k", "v");
  int fired = 0;
  s.watch({"k"}, [&] { ++fired; });
  s.remove("k");
  EXPECT_EQ(fired, 1);
}

TEST(StoreService, AWatchFromARevisionAheadOfTheRunIsAnError) {
  KvStore s;
  StoreService service(s);
  s.set("k", "v");
  const auto ahead = service.tryHandle({.op = Op::kWatch, .keys = {"k"}, .number = 5});
  ASSERT_TRUE(ahead);
  EXPECT_EQ(ahead->status, Status::kError);
  EXPECT_NE(ahead->value.find("revision 5 is ahead"), std::string::npos) << ahead->value;
  EXPECT_FALSE(service.tryHandle({.op = Op::kWatch, .keys = {"k"}, .number = 1}));
  EXPECT_EQ(service.tryHandle({.op = Op::kRevision})->number, 1);
}

class StoreWatchTest : public ::testing::Test {
 protected:
  std::unique_ptr<StoreClient> client() {
    return StoreClient::connect("127.0.0.1", server_.port(), {.connectTimeout = 5s, .timeout = 5s});
  }
  StoreServer server_{ServerOptions{}};
};

TEST_F(StoreWatchTest, AWaiterIsWokenByAnotherClientsWrite) {
  auto watcher = client();
  auto writer = client();
  const auto seen = watcher->revision();
  auto change = std::async(std::launch::async, [&] {
    return watcher->waitForChange({"a", "b"}, seen, 5000ms);
  });
  EXPECT_EQ(change.wait_for(100ms), std::future_status::timeout);
  writer->set("b", "hello");
  const auto got = change.get();
  ASSERT_TRUE(got);
  EXPECT_EQ(got->key, "b");
  EXPECT_EQ(got->value, "hello");
  EXPECT_EQ(got->revision, seen + 1);
}

TEST_F(StoreWatchTest, ChangesBetweenTwoCallsAreNotLost) {
  auto watcher = client();
  auto writer = client();
  std::uint64_t seen = watcher->revision();
  writer->set("a", "1");
  writer->set("b", "2");
  writer->remove("a");
  const std::vector<std::string> keys = {"a", "b"};
  const auto first = watcher->waitForChange(keys, seen, 1000ms);
  ASSERT_TRUE(first);
  EXPECT_EQ(first->key, "b");
  seen = first->revision;
  const auto second = watcher->waitForChange(keys, seen, 1000ms);
  ASSERT_TRUE(second);
  EXPECT_EQ(second->key, "a");
  EXPECT_FALSE(second->value);  // deleted
  seen = second->revision;
  EXPECT_FALSE(watcher->waitForChange(keys, seen, 50ms));
}

TEST_F(StoreWatchTest, EveryKindOfWriteIsAChangeAndAFailedCompareSetIsNot) {
  auto watcher = client();
  auto writer = client();
  std::uint64_t seen = watcher->revision();
  const auto next = [&](const std::string& key) {
    const auto change = watcher->waitForChange({key}, seen, 1000ms);
    if (change) seen = change->revision;
    return change;
  };
  writer->set("k", "1");
  EXPECT_EQ(next("k")->value, "1");
  writer->add("k", 1);
  EXPECT_EQ(next("k")->value, "2");
  writer->append("k", "x");
  EXPECT_EQ(next("k")->value, "2x");
  writer->compareSet("k", "not this", "y");
  EXPECT_FALSE(watcher->waitForChange({"k"}, seen, 50ms));
  writer->compareSet("k", "2x", "y");
  EXPECT_EQ(next("k")->value, "y");
  writer->multiSet({"j", "k"}, {"1", "multi"});
  EXPECT_EQ(next("k")->value, "multi");
  writer->remove("k");
  const auto deleted = next("k");
  ASSERT_TRUE(deleted);
  EXPECT_FALSE(deleted->value);
}

TEST_F(StoreWatchTest, ATimeoutReturnsNothingOnTimeAndTheConnectionGoesOn) {
  auto c = client();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(c->waitForChange({"quiet"}, c->revision(), 100ms));
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, 90ms);
  EXPECT_LT(waited, 3s);
  c->set("quiet", "1");
  EXPECT_EQ(c->get("quiet"), "1");
}

TEST_F(StoreWatchTest, ARevisionFromAnotherLifeOfTheRunIsRefused) {
  auto c = client();
  try {
    c->waitForChange({"k"}, 1000, 100ms);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ahead of this run's (0)"), std::string::npos) << e.what();
  }
  c->ping();
}

// PyTorch 1.13's watchKey on the wire (TCPStore.cpp of 1.13: QueryType WATCH_KEY = 7; the
// server answers KEY_CALLBACK_REGISTERED = 3, then sends, for every change of the key, the
// WatchResponseType (KEY_UPDATED 0, KEY_CREATED 1, KEY_DELETED 2, KEY_APPENDED 4), the key,
// the old and the new value, each with a u64 length). The same bytes c10d's own server sends:
// tests/integration/pytorch_store_test.cpp compares them.
class LegacyWatchKeyTest : public StoreWatchTest {
 protected:
  static std::vector<std::uint8_t> str(const std::string& s) {
    std::vector<std::uint8_t> out;
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(s.size() >> (8 * i)));
    out.insert(out.end(), s.begin(), s.end());
    return out;
  }
  static std::vector<std::uint8_t> update(std::uint8_t type, const std::string& key,
                                          const std::string& oldValue,
                                          const std::string& newValue) {
    std::vector<std::uint8_t> out{type};
    for (const auto& s : {key, oldValue, newValue}) {
      const auto field = str(s);
      out.insert(out.end(), field.begin(), field.end());
    }
    return out;
  }
  int connectRaw() {
    const int fd = fsdp::testing::connectLoopback(server_.port());
    EXPECT_GE(fd, 0);
    return fd;
  }
  static void sendAll(int fd, const std::vector<std::uint8_t>& bytes) {
    ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  }
  static std::vector<std::uint8_t> watchKey(const std::string& key) {
    std::vector<std::uint8_t> out{7};
    const auto field = str(key);
    out.insert(out.end(), field.begin(), field.end());
    return out;
  }
};

TEST_F(LegacyWatchKeyTest, EveryChangeOfTheKeyIsPushedAsC10dsServerPushesIt) {
  const int fd = connectRaw();
  sendAll(fd, watchKey("/k"));
  EXPECT_EQ(fsdp::testing::readUpTo(fd, 1), std::vector<std::uint8_t>({3}));  // KEY_CALLBACK_REGISTERED
  auto writer = client();  // the default run: the one PyTorch clients see
  const std::vector<std::vector<std::uint8_t>> expected = {
      update(1, "/k", "", "v1"),    // created
      update(0, "/k", "v1", "5"),   // updated (set)
      update(0, "/k", "5", "7"),    // updated (add)
      update(4, "/k", "", "ab"),    // appended: c10d sends only what was appended
      update(0, "/k", "7ab", "z"),  // compare_set that swapped
      update(2, "/k", "z", ""),     // deleted
  };
  writer->set("/k", "v1");
  writer->set("/k", "5");
  writer->add("/k", 2);
  writer->append("/k", "ab");
  writer->compareSet("/k", "no", "never");  // no swap: nothing sent
  writer->compareSet("/k", "7ab", "z");
  writer->set("/other", "x");  // not watched
  writer->remove("/k");
  for (const auto& bytes : expected) EXPECT_EQ(fsdp::testing::readUpTo(fd, bytes.size()), bytes);
  // Nothing else came.
  writer->ping();
  timeval shortWait{0, 100000};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &shortWait, sizeof(shortWait));
  std::uint8_t extra = 0;
  EXPECT_LT(::read(fd, &extra, 1), 1);
  ::close(fd);
  // The closed watcher left no observer behind: writes go on.
  writer->set("/k", "after");
  EXPECT_EQ(writer->get("/k"), "after");
}

TEST_F(LegacyWatchKeyTest, AKeyWatchedTwiceIsToldTwiceAsByC10d) {
  const int fd = connectRaw();
  sendAll(fd, watchKey("/k"));
  sendAll(fd, watchKey("/k"));
  EXPECT_EQ(fsdp::testing::readUpTo(fd, 2), std::vector<std::uint8_t>({3, 3}));
  client()->set("/k", "v");
  const auto once = update(1, "/k", "", "v");
  EXPECT_EQ(fsdp::testing::readUpTo(fd, once.size()), once);
  EXPECT_EQ(fsdp::testing::readUpTo(fd, once.size()), once);
  ::close(fd);
}

TEST(StoreServerStop, WatchersAndWaitersStillConnectedDoNotOutliveTheirStore) {
  // Their connections' cleanup runs when the server's event loop is torn down, and must find
  // their run's store alive (an ASan build checks).
  auto server = std::make_unique<StoreServer>(ServerOptions{});
  const int fd = fsdp::testing::connectLoopback(server->port());
  ASSERT_GE(fd, 0);
  const std::uint8_t watch[] = {7, 2, 0, 0, 0, 0, 0, 0, 0, '/', 'k'};
  ASSERT_EQ(::write(fd, watch, sizeof(watch)), static_cast<ssize_t>(sizeof(watch)));
  std::uint8_t registered = 0;
  ASSERT_EQ(::read(fd, &registered, 1), 1);
  const std::uint8_t wait[] = {5, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, '/', 'w'};
  ASSERT_EQ(::write(fd, wait, sizeof(wait)), static_cast<ssize_t>(sizeof(wait)));
  auto watcher = StoreClient::connect("127.0.0.1", server->port(), {.timeout = 5s});
  auto parked = std::async(std::launch::async, [&] {
    try {
      watcher->waitForChange({"x"}, watcher->revision(), 5000ms);
      return std::string("answered");
    } catch (const Error& e) {
      return std::string(e.what());
    }
  });
  EXPECT_EQ(parked.wait_for(100ms), std::future_status::timeout);
  server.reset();
  EXPECT_NE(parked.get(), "answered");
  ::close(fd);
}

}  // namespace
}  // namespace fsdp::rendezvous
