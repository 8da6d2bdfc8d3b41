// PyTorch 2.x's TCPStore protocol (the "current" dialect) on the wire, byte for byte, as the
// TCPStore.cpp and TCPStoreLibUvBackend.cpp of PyTorch 2.x write and read it: a client opens
// with VALIDATE (opcode 0, u32 magic 0x3C85F7CE, no reply) and PING (opcode 13, a u32 nonce
// the server echoes); then opcodes are 1.13's shifted by one, strings carry a u64 length, and
// numbers are little-endian. No 2.x client is installed here: these are golden bytes.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "pytorch_wire.hpp"
#include "raw_socket.hpp"

namespace fsdp::rendezvous {
namespace {

using namespace std::chrono_literals;
using fsdp::testing::pytorch_wire::Bytes;

// The opcodes of PyTorch 2.x's QueryType.
enum : std::uint8_t {
  kValidate = 0,
  kSet = 1,
  kCompareSet = 2,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kWait = 6,
  kGetNumKeys = 7,
  kDeleteKey = 8,
  kAppend = 9,
  kMultiGet = 10,
  kMultiSet = 11,
  kCancelWait = 12,
  kPing = 13,
  kQueuePush = 14,
  kQueuePop = 15,
  kQueueLen = 16,
  kListKeys = 17,
};

using fsdp::testing::pytorch_wire::request;
using fsdp::testing::pytorch_wire::str;
using fsdp::testing::pytorch_wire::u64;

class CurrentDialectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fd_ = fsdp::testing::connectLoopback(server_.port());
    ASSERT_GE(fd_, 0);
  }
  void TearDown() override { ::close(fd_); }

  void send(const Bytes& bytes) {
    ASSERT_EQ(::write(fd_, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  }
  Bytes read(std::size_t n) { return fsdp::testing::readUpTo(fd_, n); }
  // Whether the server sent nothing more within a short while.
  bool quiet() {
    timeval shortWait{0, 100000};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &shortWait, sizeof(shortWait));
    std::uint8_t byte = 0;
    const bool nothing = ::recv(fd_, &byte, 1, MSG_PEEK) < 0 && errno == EAGAIN;
    timeval tv{5, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return nothing;
  }
  // What TCPStore's constructor sends first (validate(), then ping()), and the echo it checks.
  void open() {
    send({kValidate, 0xCE, 0xF7, 0x85, 0x3C});
    send({kPing, 0x78, 0x56, 0x34, 0x12});
    EXPECT_EQ(read(4), Bytes({0x78, 0x56, 0x34, 0x12}));
  }

  StoreServer server_{ServerOptions{}};
  int fd_ = -1;
};

TEST_F(CurrentDialectTest, TheOpeningIsValidateWithoutReplyThenAnEchoedPing) {
  send({kValidate, 0xCE, 0xF7, 0x85, 0x3C});
  EXPECT_TRUE(quiet()) << "VALIDATE has no reply";
  send({kPing, 0x01, 0x02, 0x03, 0x04});
  EXPECT_EQ(read(4), Bytes({0x01, 0x02, 0x03, 0x04}));
}

TEST_F(CurrentDialectTest, KeyValueOperationsAnswerWithC10dsBytes) {
  open();
  send(request(kSet, {str("/a"), str("1")}));  // no reply
  send(request(kGet, {str("/a")}));
  EXPECT_EQ(read(9), str("1"));
  send(request(kAdd, {str("/n"), u64(5)}));
  EXPECT_EQ(read(8), u64(5));
  send(request(kCompareSet, {str("/a"), str("1"), str("2")}));
  EXPECT_EQ(read(9), str("2"));
  send(request(kCheck, {u64(2), str("/a"), str("/n")}));
  EXPECT_EQ(read(1), Bytes({0}));  // READY
  send(request(kCheck, {u64(1), str("/absent")}));
  EXPECT_EQ(read(1), Bytes({1}));  // NOT_READY
  send(request(kGetNumKeys, {}));
  EXPECT_EQ(read(8), u64(2));
  send(request(kAppend, {str("/a"), str("x")}));            // no reply
  send(request(kMultiSet, {u64(1), str("/m"), str("v")}));  // no reply
  send(request(kMultiGet, {u64(2), str("/a"), str("/m")}));
  Bytes both = str("2x");
  const Bytes v = str("v");
  both.insert(both.end(), v.begin(), v.end());
  EXPECT_EQ(read(both.size()), both);
  send(request(kDeleteKey, {str("/m")}));
  EXPECT_EQ(read(8), u64(1));
  send(request(kDeleteKey, {str("/m")}));
  EXPECT_EQ(read(8), u64(0));
  // A key gone between a client's WAIT and its GET: 2.x's libuv server answers it empty.
  send(request(kGet, {str("/m")}));
  EXPECT_EQ(read(8), u64(0));
  EXPECT_TRUE(quiet());
}

TEST_F(CurrentDialectTest, ListKeysSendsTheCountThenEveryKey) {
  open();
  send(request(kSet, {str("/a"), str("1")}));
  send(request(kSet, {str("/bb"), str("2")}));
  send(request(kListKeys, {}));
  EXPECT_EQ(read(8), u64(2));
  std::vector<std::string> keys;
  for (int i = 0; i < 2; ++i) {
    const Bytes length = read(8);
    ASSERT_EQ(length.size(), 8u);
    const Bytes key = read(length[0]);
    keys.emplace_back(key.begin(), key.end());
  }
  std::sort(keys.begin(), keys.end());
  EXPECT_EQ(keys, std::vector<std::string>({"/a", "/bb"}));
}

TEST_F(CurrentDialectTest, AWaitIsAnsweredWhenTheKeyIsSetAndCanBeCancelled) {
  open();
  send(request(kWait, {u64(1), str("/late")}));
  EXPECT_TRUE(quiet());
  StoreClient::connect("127.0.0.1", server_.port())->set("/late", "here");
  EXPECT_EQ(read(1), Bytes({0}));  // STOP_WAITING
  // A wait that times out client side: CANCEL_WAIT is answered WAIT_CANCELED, and the
  // connection goes on.
  send(request(kWait, {u64(1), str("/never")}));
  EXPECT_TRUE(quiet());
  send(request(kCancelWait, {}));
  EXPECT_EQ(read(1), Bytes({1}));  // WAIT_CANCELED
  StoreClient::connect("127.0.0.1", server_.port())->set("/never", "now");
  send(request(kGetNumKeys, {}));
  EXPECT_EQ(read(8), u64(2)) << "the cancelled wait must not answer later";
}

// PyTorch 2.8+'s queues, as TCPStoreLibUvBackend.cpp serves them: PUSH has no reply; POP
// never waits and answers the length before it, then the item when there was one; LEN a
// count. A blocking pop is the client's WAIT on the key, then POP: a push wakes one waiter.
TEST_F(CurrentDialectTest, QueuesPushPopAndLenAsC10dServesThem) {
  open();
  send(request(kQueueLen, {str("/q")}));
  EXPECT_EQ(read(8), u64(0));
  send(request(kQueuePop, {str("/q")}));
  EXPECT_EQ(read(8), u64(0)) << "an empty queue: the length 0 and nothing else";
  send(request(kCheck, {u64(1), str("/q")}));
  EXPECT_EQ(read(1), Bytes({1}));  // NOT_READY
  send(request(kQueuePush, {str("/q"), str("one")}));
  send(request(kQueuePush, {str("/q"), str("two")}));
  send(request(kQueueLen, {str("/q")}));
  EXPECT_EQ(read(8), u64(2));
  send(request(kCheck, {u64(1), str("/q")}));
  EXPECT_EQ(read(1), Bytes({0})) << "a non-empty queue counts as present";
  send(request(kGetNumKeys, {}));
  EXPECT_EQ(read(8), u64(0)) << "queues are not keys";
  send(request(kQueuePop, {str("/q")}));
  Bytes first = u64(2);
  const Bytes one = str("one");
  first.insert(first.end(), one.begin(), one.end());
  EXPECT_EQ(read(first.size()), first);
  send(request(kQueuePop, {str("/q")}));
  Bytes second = u64(1);
  const Bytes two = str("two");
  second.insert(second.end(), two.begin(), two.end());
  EXPECT_EQ(read(second.size()), second);
  send(request(kQueueLen, {str("/q")}));
  EXPECT_EQ(read(8), u64(0));
  EXPECT_TRUE(quiet());
}

TEST_F(CurrentDialectTest, APushWakesOneWaiterOfTheQueue) {
  open();
  const int other = fsdp::testing::connectLoopback(server_.port());
  ASSERT_GE(other, 0);
  const Bytes opening{kValidate, 0xCE, 0xF7, 0x85, 0x3C};
  const Bytes wait = request(kWait, {u64(1), str("/jobs")});
  ASSERT_EQ(::write(other, opening.data(), opening.size()), 5);
  ASSERT_EQ(::write(other, wait.data(), wait.size()), static_cast<ssize_t>(wait.size()));
  send(wait);
  EXPECT_TRUE(quiet());
  // A third client pushes one item: one of the two waiters is answered, the other waits on.
  const int pusher = fsdp::testing::connectLoopback(server_.port());
  Bytes push = opening;
  const Bytes item = request(kQueuePush, {str("/jobs"), str("x")});
  push.insert(push.end(), item.begin(), item.end());
  ASSERT_EQ(::write(pusher, push.data(), push.size()), static_cast<ssize_t>(push.size()));
  std::uint8_t byte = 0xff;
  timeval tv{0, 300000};
  ::setsockopt(other, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  const bool otherWoke = ::recv(other, &byte, 1, 0) == 1;
  const bool thisWoke = !quiet();
  EXPECT_NE(otherWoke, thisWoke) << "exactly one waiter wakes per push";
  // The second push wakes the other.
  const Bytes again = request(kQueuePush, {str("/jobs"), str("y")});
  ASSERT_EQ(::write(pusher, again.data(), again.size()), static_cast<ssize_t>(again.size()));
  if (otherWoke) {
    EXPECT_EQ(read(1), Bytes({0}));
  } else {
    timeval longer{5, 0};
    ::setsockopt(other, SOL_SOCKET, SO_RCVTIMEO, &longer, sizeof(longer));
    EXPECT_EQ(::recv(other, &byte, 1, 0), 1);
    EXPECT_EQ(byte, 0);
  }
  ::close(pusher);
  ::close(other);
}

// c10d counts writes, not presence: a key set and deleted again before the waiter was
// answered still answers it (a 2.x client would otherwise sit out its whole timeout).
TEST_F(CurrentDialectTest, AWaitIsAnsweredWhenItsKeyWasSetThenDeleted) {
  open();
  send(request(kWait, {u64(2), str("/gone"), str("/also")}));
  EXPECT_TRUE(quiet());
  auto writer = StoreClient::connect("127.0.0.1", server_.port());
  writer->set("/gone", "1");
  writer->remove("/gone");
  EXPECT_TRUE(quiet()) << "one key is still unwritten";
  writer->set("/also", "2");
  EXPECT_EQ(read(1), Bytes({0}));  // STOP_WAITING
  EXPECT_TRUE(quiet());
}

// PyTorch's libuv server takes keys of up to 8 KiB and 131,072 keys per request.
TEST_F(CurrentDialectTest, KeysAsLongAndAsManyAsC10dAcceptsWork) {
  open();
  const std::string longKey = "/" + std::string(8191, 'k');
  send(request(kSet, {str(longKey), str("v")}));
  send(request(kGet, {str(longKey)}));
  EXPECT_EQ(read(9), str("v"));
  Bytes check = request(kCheck, {u64(131072)});
  for (int i = 0; i < 131072; ++i) {
    const Bytes key = str(i == 0 ? longKey : "/m" + std::to_string(i));
    check.insert(check.end(), key.begin(), key.end());
  }
  send(check);
  EXPECT_EQ(read(1), Bytes({1}));  // NOT_READY: the others are missing, and it was read whole
  send(request(kGetNumKeys, {}));
  EXPECT_EQ(read(8), u64(1));
}

// PyTorch 2.1's client sends no VALIDATE and numbers opcodes as 1.13 did up to 6, then
// 7 DELETE_KEY, 8 APPEND, 9 MULTI_GET, 10 MULTI_SET, 11 CANCEL_WAIT (1.13: 7 WATCH_KEY,
// 8 DELETE_KEY). Its requests are told apart from 1.13's and answered in its numbering.
TEST_F(CurrentDialectTest, APyTorch21ClientIsRecognisedAndServedInItsNumbering) {
  enum : std::uint8_t { kSet21 = 0, kGet21 = 2, kAdd21 = 3, kDelete21 = 7, kAppend21 = 8,
                        kMultiGet21 = 9, kMultiSet21 = 10, kCancelWait21 = 11 };
  send(request(kAdd21, {str("init/"), u64(1)}));  // what its constructor sends first
  EXPECT_EQ(read(8), u64(1));
  send(request(kSet21, {str("/a"), str("1")}));
  send(request(kAppend21, {str("/a"), str("23")}));  // no reply
  send(request(kGet21, {str("/a")}));
  EXPECT_EQ(read(11), str("123"));
  send(request(kDelete21, {str("/a")}));
  EXPECT_EQ(read(8), u64(1)) << "7 is DELETE_KEY here, not WATCH_KEY";
  send(request(kMultiSet21, {u64(2), str("/x"), str("1"), str("/y"), str("2")}));
  send(request(kMultiGet21, {u64(2), str("/x"), str("/y")}));
  Bytes both = str("1");
  const Bytes y = str("2");
  both.insert(both.end(), y.begin(), y.end());
  EXPECT_EQ(read(both.size()), both);
  send(request(5 /* WAIT */, {u64(1), str("/never")}));
  EXPECT_TRUE(quiet());
  send(request(kCancelWait21, {}));
  EXPECT_EQ(read(1), Bytes({1}));  // WAIT_CANCELED
  EXPECT_TRUE(quiet());
}

// 1.13's DELETE_KEY (8) is a key alone, after which the client waits for the reply; 2.1's 8
// (APPEND) carries a value in the same write. An undecided connection's 8 is the former when
// nothing follows the key.
TEST_F(CurrentDialectTest, APyTorch113DeleteIsStillADelete) {
  send(request(0 /* SET */, {str("/d"), str("v")}));
  send(request(8, {str("/d")}));
  EXPECT_EQ(read(8), u64(1));
  send(request(8, {str("/d")}));
  EXPECT_EQ(read(8), u64(0));
  send(request(6 /* GETNUMKEYS */, {}));
  EXPECT_EQ(read(8), u64(0));
}

}  // namespace
}  // namespace fsdp::rendezvous
