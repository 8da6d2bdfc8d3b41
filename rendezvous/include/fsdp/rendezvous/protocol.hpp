#pragma once
// fsdprun's own store protocol: length-prefixed binary frames. Pure encode/decode functions,
// no I/O, so that every bound is unit-tested and fuzzable.
//
// Frame = header (12 bytes, little endian) + body:
//   u32 magic 0x50445346 ("FSDP") | u8 version | u8 op | u16 stream | u32 body length
// `stream` is 0 except on a multiplexed connection (see MUX): a node's store proxy carries
// every local client's frames on one connection to the server, each client a stream.
// Request body (same layout for every op):
//   u32 nkeys, nkeys × (u32 len, bytes) | u32 len, value | u32 len, value2 | i64 number |
//   u32 timeout_ms
// Response body: u8 status | i64 number | u32 len, value (the error text when status = error)
// The first byte 'F' (0x46) tells this protocol apart from PyTorch's TCPStore dialects,
// whose connections start with a small opcode.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace fsdp::rendezvous {

inline constexpr std::uint32_t kMagic = 0x50445346;
inline constexpr std::uint8_t kVersion = 1;
inline constexpr std::size_t kHeaderSize = 12;

enum class Op : std::uint8_t {
  kPing = 0,
  kSet = 1,
  kGet = 2,  // waits (server side) until the key exists or timeout_ms passes
  kAdd = 3,
  kCheck = 4,
  kWait = 5,  // waits until every key exists or timeout_ms passes
  kDelete = 6,
  kNumKeys = 7,
  kCompareSet = 8,
  kAppend = 9,
  kMultiGet = 10,  // non-waiting; missing keys are an error
  kMultiSet = 11,
  // Session and rendezvous ops.
  kHello = 12,      // keys[0] = run id, value = client nonce; reply: number = 1 if AUTH is
                    // required, value = server nonce
  kAuth = 13,       // value = HMAC-SHA256(token, authMessage(...)); reply OK, or error + close
  kJoin = 14,       // value = JSON JoinRequest; answered by an EVENT (assigned / join failed)
  kHeartbeat = 15,  // no reply
  kEndRound = 16,   // value = reason; no reply (every member gets a ROUND_ENDED event)
  kCloseRun = 17,   // value = reason; no reply (everyone gets RUN_CLOSED)
  kEvent = 18,      // server to client only: number = EventKind, value = JSON or reason
  kAddWait = 19,    // a counter barrier: keys[0] += number, then answered once the counter is
                    // >= value (decimal) or timeout_ms passed; reply number = the counter
  kSucceeded = 20,  // every worker of this member's node exited 0; no reply (the run finishes
                    // with a RUN_FINISHED event once every member has said so)
  kWatch = 21,      // number = revision seen; answered (server side, like WAIT) once one of keys
                    // changed after it, or timeout_ms passed: value = key, values = {value now}
                    // or {} when deleted, number = that change's revision
  kRevision = 22,   // reply number = the run's revision (see KvStore::revision)
  kMux = 23,        // on an authenticated connection: from now on it carries streams 1-65535,
                    // each an independent client (its own HELLO/AUTH, run, waits), answered
                    // on its stream; stream 0 stays the connection's own
  kEndStream = 24,  // proxy to server: the stream's client went away (its waits are dropped);
                    // server to proxy: the stream is over (the ack of the former, or the
                    // server ended it: close its client). Its number is free after this frame
};
inline constexpr std::uint8_t kMaxOp = 24;

// The message a client MACs to authenticate: binds the token proof to this run and both
// nonces, so a recorded proof cannot be replayed on another connection.
std::string authMessage(const std::string& runId, const std::string& clientNonce,
                        const std::string& serverNonce);

std::string opName(Op op);

enum class Status : std::uint8_t { kOk = 0, kTimeout = 1, kError = 2 };

// Bounds on everything read off the wire. A frame that exceeds one is a ProtocolError, which
// closes that connection only.
struct Limits {
  std::uint32_t maxBodyBytes = 64u << 20;
  // Keys and key counts as large as PyTorch's own server takes (its libuv backend: 8 KiB,
  // 131,072), so that no client it serves is refused here.
  std::uint32_t maxKeyBytes = 8192;
  std::uint32_t maxValueBytes = 32u << 20;
  std::uint32_t maxKeysPerRequest = 131072;
  std::uint64_t maxRunBytes = 1ull << 30;  // keys + values held per run
};

// One change of a watched key, as a watch reports it.
struct KeyChange {
  std::string key;
  std::optional<std::string> value;  // the value now; nullopt when the key was deleted
  std::uint64_t revision = 0;        // the run's revision of this change
};

struct Header {
  Op op = Op::kPing;
  std::uint32_t bodyLength = 0;
  std::uint16_t stream = 0;
};

// Sets the stream field of an encoded frame (at least kHeaderSize bytes) in place.
void setFrameStream(std::span<std::uint8_t> frame, std::uint16_t stream);

struct Request {
  Op op = Op::kPing;
  std::vector<std::string> keys;
  std::string value;                // SET, APPEND, COMPARE_SET (expected); MULTI_SET: unused
  std::string value2;               // COMPARE_SET (desired)
  std::vector<std::string> values;  // MULTI_SET values, one per key
  std::int64_t number = 0;          // ADD delta
  std::uint32_t timeoutMs = 0;      // GET, WAIT
};

struct Response {
  Status status = Status::kOk;
  std::int64_t number = 0;
  std::string value;                // value, or error text
  std::vector<std::string> values;  // MULTI_GET
};

// Throws ProtocolError on a bad magic, version or op, or a length over limits.
Header decodeHeader(std::span<const std::uint8_t> bytes, const Limits& limits);

std::vector<std::uint8_t> encodeRequest(const Request& request);
// Throws ProtocolError on truncation, trailing bytes, or a size over limits.
Request decodeRequest(Op op, std::span<const std::uint8_t> body, const Limits& limits);

std::vector<std::uint8_t> encodeResponse(Op op, const Response& response);
Response decodeResponse(std::span<const std::uint8_t> body, const Limits& limits);

}  // namespace fsdp::rendezvous
