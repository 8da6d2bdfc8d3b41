// Replays random and mutated frames through the fuzzer's body in every build (the libFuzzer
// target itself needs clang: make fuzz).
#include <gtest/gtest.h>

#include <random>

#include "frame_fuzz.hpp"
#include "fsdp/rendezvous/protocol.hpp"
#include "fsdp/rendezvous/round.hpp"

namespace fsdp::rendezvous {
namespace {

TEST(FrameFuzzReplay, DecodersSurviveRandomAndMutatedInput) {
  std::mt19937 rng(20261122);
  std::vector<std::vector<std::uint8_t>> seeds = {
      encodeRequest({.op = Op::kSet, .keys = {"k"}, .value = "v"}),
      encodeRequest({.op = Op::kMultiSet, .keys = {"a", "b"}, .values = {"1", "2"}}),
      encodeRequest({.op = Op::kWait, .keys = {"x", "y", "z"}, .timeoutMs = 5}),
      encodeResponse(Op::kMultiGet, Response{Status::kOk, 1, "v", {"a", "b"}}),
  };
  const std::string join = encodeJoin(JoinRequest{.node = "n"});
  seeds.emplace_back(join.begin(), join.end());
  for (int i = 0; i < 20000; ++i) {
    std::vector<std::uint8_t> input;
    if (i % 4 == 0) {
      input.resize(rng() % 96);
      for (auto& b : input) b = static_cast<std::uint8_t>(rng());
    } else {
      input = seeds[rng() % seeds.size()];
      const int flips = 1 + static_cast<int>(rng() % 4);
      for (int f = 0; f < flips && !input.empty(); ++f) {
        input[rng() % input.size()] = static_cast<std::uint8_t>(rng());
      }
      if (rng() % 3 == 0) input.resize(rng() % (input.size() + 1));  // truncate
    }
    fuzzFrameDecoders(input.data(), input.size());
  }
  SUCCEED();
}

}  // namespace
}  // namespace fsdp::rendezvous
