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
#include "raw_socket.hpp"

namespace fsdp::rendezvous {
namespace {

using namespace std::chrono_literals;
using Bytes = std::vector<std::uint8_t>;

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
  kListKeys = 17,
};

Bytes u64(std::uint64_t v) {
  Bytes out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  return out;
}

Bytes str(const std::string& s) {
  Bytes out = u64(s.size());
  out.insert(out.end(), s.begin(), s.end());
  return out;
}

// Concatenates an opcode and its fields.
Bytes request(std::uint8_t op, std::initializer_list<Bytes> fields) {
  Bytes out{op};
  for (const auto& f : fields) out.insert(out.end(), f.begin(), f.end());
  return out;
}

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

TEST_F(CurrentDialectTest, QueuesAreRefusedByClosingTheConnection) {
  open();
  send(request(kQueuePush, {str("/q"), str("v")}));
  EXPECT_EQ(read(1).size(), 0u) << "the server must close the connection";
  // Others are untouched.
  auto other = StoreClient::connect("127.0.0.1", server_.port());
  other->set("k", "v");
  EXPECT_EQ(other->get("k"), "v");
}

}  // namespace
}  // namespace fsdp::rendezvous
