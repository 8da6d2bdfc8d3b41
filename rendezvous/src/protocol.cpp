#include "fsdp/rendezvous/protocol.hpp"

#include <cstring>

#include "fsdp/common/error.hpp"

namespace fsdp::rendezvous {
namespace {

class Writer {
 public:
  void u8(std::uint8_t v) { out_.push_back(v); }
  void u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  }
  void i64(std::int64_t v) {
    const auto u = static_cast<std::uint64_t>(v);
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<std::uint8_t>(u >> (8 * i)));
  }
  void str(const std::string& s) {
    u32(static_cast<std::uint32_t>(s.size()));
    out_.insert(out_.end(), s.begin(), s.end());
  }
  void strs(const std::vector<std::string>& list) {
    u32(static_cast<std::uint32_t>(list.size()));
    for (const auto& s : list) str(s);
  }
  std::vector<std::uint8_t>& bytes() { return out_; }

 private:
  std::vector<std::uint8_t> out_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::uint8_t> in) : in_(in) {}
  std::uint8_t u8() {
    need(1);
    return in_[pos_++];
  }
  std::uint32_t u32() {
    need(4);
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= std::uint32_t{in_[pos_ + i]} << (8 * i);
    pos_ += 4;
    return v;
  }
  std::int64_t i64() {
    need(8);
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= std::uint64_t{in_[pos_ + i]} << (8 * i);
    pos_ += 8;
    return static_cast<std::int64_t>(v);
  }
  std::string str(std::uint32_t maxBytes, const char* what) {
    const auto n = u32();
    if (n > maxBytes) {
      throw ProtocolError(std::string(what) + " of " + std::to_string(n) +
                          " bytes exceeds the limit of " + std::to_string(maxBytes));
    }
    need(n);
    std::string s(reinterpret_cast<const char*>(in_.data() + pos_), n);
    pos_ += n;
    return s;
  }
  std::vector<std::string> strs(std::uint32_t maxCount, std::uint32_t maxBytes, const char* what) {
    const auto n = u32();
    if (n > maxCount) {
      throw ProtocolError(std::to_string(n) + " " + what + "s in one frame exceed the limit of " +
                          std::to_string(maxCount));
    }
    // Every entry takes at least 4 bytes: bound the count by what is left before reserving.
    need(std::size_t{n} * 4);
    std::vector<std::string> out;
    out.reserve(n);
    for (std::uint32_t i = 0; i < n; ++i) out.push_back(str(maxBytes, what));
    return out;
  }
  void end() const {
    if (pos_ != in_.size()) {
      throw ProtocolError(std::to_string(in_.size() - pos_) +
                          " unexpected trailing bytes in frame");
    }
  }

 private:
  void need(std::size_t n) const {
    if (in_.size() - pos_ < n) {
      throw ProtocolError("truncated frame: needed " + std::to_string(n) +
                          " more bytes at offset " + std::to_string(pos_) + " of " +
                          std::to_string(in_.size()));
    }
  }
  std::span<const std::uint8_t> in_;
  std::size_t pos_ = 0;
};

std::vector<std::uint8_t> frame(Op op, std::vector<std::uint8_t> body) {
  Writer header;
  header.bytes().reserve(kHeaderSize + body.size());
  header.u32(kMagic);
  header.u8(kVersion);
  header.u8(static_cast<std::uint8_t>(op));
  header.u8(0);
  header.u8(0);
  header.u32(static_cast<std::uint32_t>(body.size()));
  auto out = std::move(header.bytes());
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

}  // namespace

std::string authMessage(const std::string& runId, const std::string& clientNonce,
                        const std::string& serverNonce) {
  return "fsdprun-auth-v1\n" + runId + "\n" + clientNonce + "\n" + serverNonce;
}

std::string opName(Op op) {
  switch (op) {
    case Op::kPing:
      return "PING";
    case Op::kSet:
      return "SET";
    case Op::kGet:
      return "GET";
    case Op::kAdd:
      return "ADD";
    case Op::kCheck:
      return "CHECK";
    case Op::kWait:
      return "WAIT";
    case Op::kDelete:
      return "DELETE";
    case Op::kNumKeys:
      return "NUM_KEYS";
    case Op::kCompareSet:
      return "COMPARE_SET";
    case Op::kAppend:
      return "APPEND";
    case Op::kMultiGet:
      return "MULTI_GET";
    case Op::kMultiSet:
      return "MULTI_SET";
    case Op::kHello:
      return "HELLO";
    case Op::kAuth:
      return "AUTH";
    case Op::kJoin:
      return "JOIN";
    case Op::kHeartbeat:
      return "HEARTBEAT";
    case Op::kEndRound:
      return "END_ROUND";
    case Op::kCloseRun:
      return "CLOSE_RUN";
    case Op::kEvent:
      return "EVENT";
    case Op::kAddWait:
      return "ADD_WAIT";
    case Op::kSucceeded:
      return "SUCCEEDED";
    case Op::kWatch:
      return "WATCH";
    case Op::kRevision:
      return "REVISION";
    case Op::kMux:
      return "MUX";
    case Op::kEndStream:
      return "END_STREAM";
  }
  return "op " + std::to_string(static_cast<int>(op));
}

Header decodeHeader(std::span<const std::uint8_t> bytes, const Limits& limits) {
  if (bytes.size() != kHeaderSize) {
    throw ProtocolError("frame header must be " + std::to_string(kHeaderSize) + " bytes, got " +
                        std::to_string(bytes.size()));
  }
  Reader r(bytes);
  const auto magic = r.u32();
  if (magic != kMagic) throw ProtocolError("bad frame magic " + std::to_string(magic));
  const auto version = r.u8();
  if (version != kVersion) {
    throw ProtocolError("unsupported protocol version " + std::to_string(version) +
                        " (server speaks " + std::to_string(kVersion) + ")");
  }
  const auto op = r.u8();
  if (op > kMaxOp) throw ProtocolError("unknown op " + std::to_string(op));
  const std::uint16_t stream = static_cast<std::uint16_t>(r.u8() | (r.u8() << 8));
  Header h{static_cast<Op>(op), r.u32(), stream};
  if (h.bodyLength > limits.maxBodyBytes) {
    throw ProtocolError("frame body of " + std::to_string(h.bodyLength) +
                        " bytes exceeds the limit of " + std::to_string(limits.maxBodyBytes));
  }
  return h;
}

void setFrameStream(std::span<std::uint8_t> frame, std::uint16_t stream) {
  if (frame.size() < kHeaderSize) throw ProtocolError("setFrameStream: not a frame");
  frame[6] = static_cast<std::uint8_t>(stream & 0xff);
  frame[7] = static_cast<std::uint8_t>(stream >> 8);
}

std::vector<std::uint8_t> encodeRequest(const Request& request) {
  Writer w;
  std::size_t size = 64 + request.value.size() + request.value2.size();
  for (const auto& k : request.keys) size += 4 + k.size();
  for (const auto& v : request.values) size += 4 + v.size();
  w.bytes().reserve(size);
  w.strs(request.keys);
  w.str(request.value);
  w.str(request.value2);
  w.strs(request.values);
  w.i64(request.number);
  w.u32(request.timeoutMs);
  return frame(request.op, std::move(w.bytes()));
}

Request decodeRequest(Op op, std::span<const std::uint8_t> body, const Limits& limits) {
  Reader r(body);
  Request req;
  req.op = op;
  req.keys = r.strs(limits.maxKeysPerRequest, limits.maxKeyBytes, "key");
  req.value = r.str(limits.maxValueBytes, "value");
  req.value2 = r.str(limits.maxValueBytes, "value");
  req.values = r.strs(limits.maxKeysPerRequest, limits.maxValueBytes, "value");
  req.number = r.i64();
  req.timeoutMs = r.u32();
  r.end();
  const auto needKeys = [&](std::size_t n) {
    if (req.keys.size() != n) {
      throw ProtocolError(opName(op) + " needs " + std::to_string(n) + " key(s), got " +
                          std::to_string(req.keys.size()));
    }
  };
  switch (op) {
    case Op::kSet:
    case Op::kGet:
    case Op::kAdd:
    case Op::kDelete:
    case Op::kCompareSet:
    case Op::kAppend:
    case Op::kHello:
    case Op::kAddWait:
      needKeys(1);
      break;
    case Op::kMultiSet:
      if (req.values.size() != req.keys.size()) {
        throw ProtocolError("MULTI_SET with " + std::to_string(req.keys.size()) + " keys and " +
                            std::to_string(req.values.size()) + " values");
      }
      break;
    case Op::kWatch:
      if (req.keys.empty()) throw ProtocolError("WATCH needs at least one key");
      break;
    case Op::kPing:
    case Op::kRevision:
    case Op::kNumKeys:
    case Op::kCheck:
    case Op::kWait:
    case Op::kMultiGet:
    case Op::kAuth:
    case Op::kJoin:
    case Op::kHeartbeat:
    case Op::kEndRound:
    case Op::kCloseRun:
    case Op::kSucceeded:
    case Op::kEvent:
    case Op::kMux:
    case Op::kEndStream:
      break;
  }
  return req;
}

std::vector<std::uint8_t> encodeResponse(Op op, const Response& response) {
  Writer w;
  w.bytes().reserve(kHeaderSize + 32 + response.value.size());
  w.u8(static_cast<std::uint8_t>(response.status));
  w.i64(response.number);
  w.str(response.value);
  w.strs(response.values);
  return frame(op, std::move(w.bytes()));
}

Response decodeResponse(std::span<const std::uint8_t> body, const Limits& limits) {
  Reader r(body);
  Response resp;
  const auto status = r.u8();
  if (status > static_cast<std::uint8_t>(Status::kError)) {
    throw ProtocolError("unknown response status " + std::to_string(status));
  }
  resp.status = static_cast<Status>(status);
  resp.number = r.i64();
  resp.value = r.str(limits.maxValueBytes, "value");
  resp.values = r.strs(limits.maxKeysPerRequest, limits.maxValueBytes, "value");
  r.end();
  return resp;
}

}  // namespace fsdp::rendezvous
