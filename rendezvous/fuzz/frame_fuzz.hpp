#pragma once
// The body of the frame-decoder fuzzer, shared by the libFuzzer target (clang,
// -DFSDP_FUZZ=ON) and by a GoogleTest that replays random inputs in every build.

#include <cstddef>
#include <cstdint>

namespace fsdp::rendezvous {

// Feeds `data` to every decoder that reads bytes off the wire: the frame header, request and
// response bodies (under tight and default limits) and the JOIN payload. Decoders may throw
// ProtocolError only; anything else (a crash, another exception, a sanitizer report) is a bug.
void fuzzFrameDecoders(const std::uint8_t* data, std::size_t size);

}  // namespace fsdp::rendezvous
