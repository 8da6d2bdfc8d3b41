#include "fsdp/rendezvous/protocol.hpp"

#include <gtest/gtest.h>

#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/kv_store.hpp"

namespace fsdp::rendezvous {
namespace {

std::span<const std::uint8_t> bodyOf(const std::vector<std::uint8_t>& frame) {
  return std::span(frame).subspan(kHeaderSize);
}

TEST(Protocol, RequestRoundTrips) {
  Request req{.op = Op::kCompareSet, .keys = {"k"}, .value = "old", .value2 = "new", .number = -7,
              .timeoutMs = 1234};
  const auto frame = encodeRequest(req);
  const Header h = decodeHeader(std::span(frame).first(kHeaderSize), Limits{});
  EXPECT_EQ(h.op, Op::kCompareSet);
  EXPECT_EQ(h.bodyLength, frame.size() - kHeaderSize);
  const Request back = decodeRequest(h.op, bodyOf(frame), Limits{});
  EXPECT_EQ(back.keys, req.keys);
  EXPECT_EQ(back.value, "old");
  EXPECT_EQ(back.value2, "new");
  EXPECT_EQ(back.number, -7);
  EXPECT_EQ(back.timeoutMs, 1234u);
}

TEST(Protocol, ResponseRoundTrips) {
  const Response resp{Status::kTimeout, 42, "a,b", {"x", "y"}};
  const auto frame = encodeResponse(Op::kWait, resp);
  const Response back = decodeResponse(bodyOf(frame), Limits{});
  EXPECT_EQ(back.status, Status::kTimeout);
  EXPECT_EQ(back.number, 42);
  EXPECT_EQ(back.value, "a,b");
  EXPECT_EQ(back.values, std::vector<std::string>({"x", "y"}));
}

TEST(Protocol, RejectsBadHeaders) {
  auto frame = encodeRequest({.op = Op::kPing});
  auto header = std::vector<std::uint8_t>(frame.begin(), frame.begin() + kHeaderSize);
  auto bad = header;
  bad[0] ^= 0xff;
  EXPECT_THROW(decodeHeader(bad, Limits{}), ProtocolError);  // magic
  bad = header;
  bad[4] = 99;
  EXPECT_THROW(decodeHeader(bad, Limits{}), ProtocolError);  // version
  bad = header;
  bad[5] = 200;
  EXPECT_THROW(decodeHeader(bad, Limits{}), ProtocolError);  // op
  bad = header;
  bad[8] = bad[9] = bad[10] = bad[11] = 0xff;
  EXPECT_THROW(decodeHeader(bad, Limits{}), ProtocolError);  // length over the cap
  EXPECT_THROW(decodeHeader(std::span(header).first(5), Limits{}), ProtocolError);
}

TEST(Protocol, EveryTruncationOfABodyIsRejected) {
  const auto frame = encodeRequest({.op = Op::kSet, .keys = {"key"}, .value = "value"});
  const auto body = bodyOf(frame);
  for (std::size_t n = 0; n < body.size(); ++n) {
    EXPECT_THROW(decodeRequest(Op::kSet, body.first(n), Limits{}), ProtocolError) << n;
  }
}

TEST(Protocol, OversizedKeysAndCountsAreRejectedBeforeAllocation) {
  Limits small;
  small.maxKeyBytes = 4;
  const auto frame = encodeRequest({.op = Op::kGet, .keys = {"too-long"}});
  EXPECT_THROW(decodeRequest(Op::kGet, bodyOf(frame), small), ProtocolError);
  // A key count of 2^32-1 with a 4-byte body must not reserve anything.
  const std::vector<std::uint8_t> lying = {0xff, 0xff, 0xff, 0xff};
  EXPECT_THROW(decodeRequest(Op::kCheck, lying, Limits{}), ProtocolError);
}

TEST(Protocol, WrongKeyCountForTheOpIsRejected) {
  const auto frame = encodeRequest({.op = Op::kSet, .keys = {"a", "b"}});
  EXPECT_THROW(decodeRequest(Op::kSet, bodyOf(frame), Limits{}), ProtocolError);
}

TEST(KvStore, AddCompareSetAppendAndDelete) {
  KvStore s;
  EXPECT_EQ(s.add("n", 2), 2);
  EXPECT_EQ(s.add("n", 3), 5);
  s.set("text", "x");
  EXPECT_THROW(s.add("text", 1), ProtocolError);
  EXPECT_EQ(s.compareSet("c", "", "first"), "first");     // absent + empty expected: set
  EXPECT_EQ(s.compareSet("c", "wrong", "second"), "first");
  EXPECT_EQ(s.compareSet("c", "first", "second"), "second");
  EXPECT_EQ(s.compareSet("absent", "x", "y"), "x");       // absent + non-empty: unchanged
  EXPECT_FALSE(s.contains("absent"));
  EXPECT_EQ(s.append("text", "yz"), 3);
  EXPECT_TRUE(s.remove("text"));
  EXPECT_FALSE(s.remove("text"));
  EXPECT_EQ(s.size(), 2u);
}

TEST(KvStore, WatchFiresOnceOnTheFirstWriteOfAnyKey) {
  KvStore s;
  int fired = 0;
  s.watch({"a", "b"}, [&] { ++fired; });
  s.set("other", "1");
  EXPECT_EQ(fired, 0);
  s.set("b", "1");
  s.set("a", "1");
  EXPECT_EQ(fired, 1);
  EXPECT_EQ(s.watchCount(), 0u);
  const auto id = s.watch({"c"}, [&] { ++fired; });
  s.unwatch(id);
  s.set("c", "1");
  EXPECT_EQ(fired, 1);
}

TEST(KvStore, CounterWatchesFireOnlyWhenTheirThresholdIsCrossed) {
  KvStore s;
  std::vector<int> fired;
  s.watchCounter("n", 2, [&] { fired.push_back(2); });
  s.watchCounter("n", 3, [&] { fired.push_back(3); });
  const auto gone = s.watchCounter("n", 3, [&] { fired.push_back(-1); });
  s.unwatch(gone);
  s.add("n", 1);
  EXPECT_TRUE(fired.empty());
  s.add("n", 1);
  EXPECT_EQ(fired, std::vector<int>({2}));
  s.add("n", 5);
  EXPECT_EQ(fired, std::vector<int>({2, 3}));
  EXPECT_EQ(s.watchCount(), 0u);
}

TEST(StoreService, GetAndWaitAskToWaitUntilTheKeysExist) {
  KvStore s;
  StoreService service(s);
  EXPECT_FALSE(service.tryHandle({.op = Op::kGet, .keys = {"k"}}));
  EXPECT_FALSE(service.tryHandle({.op = Op::kWait, .keys = {"k", "j"}}));
  s.set("k", "v");
  EXPECT_EQ(service.tryHandle({.op = Op::kGet, .keys = {"k"}})->value, "v");
  EXPECT_FALSE(service.tryHandle({.op = Op::kWait, .keys = {"k", "j"}}));
  const auto missing = service.tryHandle({.op = Op::kMultiGet, .keys = {"k", "j"}});
  EXPECT_EQ(missing->status, Status::kError);
}

}  // namespace
}  // namespace fsdp::rendezvous
