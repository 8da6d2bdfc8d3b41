#include "frame_fuzz.hpp"

#include <span>
#include <string>

#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/protocol.hpp"
#include "fsdp/rendezvous/round.hpp"

namespace fsdp::rendezvous {

void fuzzFrameDecoders(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::uint8_t> bytes(data, size);
  Limits tight;
  tight.maxBodyBytes = 4096;
  tight.maxKeyBytes = 64;
  tight.maxValueBytes = 1024;
  tight.maxKeysPerRequest = 16;
  for (const Limits& limits : {tight, Limits{}}) {
    try {
      if (bytes.size() >= kHeaderSize) {
        const Header h = decodeHeader(bytes.first(kHeaderSize), limits);
        const auto body = bytes.subspan(kHeaderSize);
        decodeRequest(h.op, body.first(std::min<std::size_t>(body.size(), h.bodyLength)), limits);
      }
    } catch (const ProtocolError&) {
    }
    for (std::uint8_t op = 0; op <= kMaxOp; ++op) {
      try {
        decodeRequest(static_cast<Op>(op), bytes, limits);
      } catch (const ProtocolError&) {
      }
    }
    try {
      decodeResponse(bytes, limits);
    } catch (const ProtocolError&) {
    }
  }
  try {
    decodeJoin(std::string(reinterpret_cast<const char*>(data), size));
  } catch (const ProtocolError&) {
  }
}

}  // namespace fsdp::rendezvous

#ifdef FSDP_LIBFUZZER
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fsdp::rendezvous::fuzzFrameDecoders(data, size);
  return 0;
}
#endif
