#pragma once
// One check for every communicator: each operation, every dtype, sizes that do not divide by
// the world (and zero), against the values computed locally. Used by the Gloo, shared-memory
// and hierarchical tests.

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "fsdp/worker/communicator.hpp"

namespace fsdp::testing {

namespace fw = fsdp::worker;

// Rank r's input for a seed: values that make every reduction's order visible in fp32.
inline at::Tensor inputOf(int rank, std::int64_t n, at::ScalarType type, int seed) {
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(seed * 131 + rank));
  auto values = at::randn({n}, gen);
  if (at::isIntegralType(type, false)) values = values.mul(50).round();
  return values.to(type);
}

// Every operation on `comm` (rank `rank` of `world`) against the values computed locally.
// `oneRounding`: 16-bit sums are accumulated in fp32 and rounded once (shared memory); else
// each partial sum is rounded (Gloo sums bf16 in bf16), and the bound grows with the world.
inline void checkEveryOperation(fw::Communicator& comm, int rank, int world, bool oneRounding = true) {
  for (const auto type : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong}) {
    for (const std::int64_t n : {0L, 1L, 7L, 1001L, 10007L}) {
      SCOPED_TRACE(std::string(c10::toString(type)) + " n=" + std::to_string(n) + " rank " + std::to_string(rank));
      const auto counts = fw::chunkSizes(n, world);
      const auto offsets = fw::chunkOffsets(counts);
      const auto offset = offsets[static_cast<std::size_t>(rank)];
      const auto mine = counts[static_cast<std::size_t>(rank)];
      std::vector<at::Tensor> all;
      for (int r = 0; r < world; ++r) all.push_back(inputOf(r, n, type, 1));
      // The expected reductions, in fp32 (fp64 for doubles) with one rounding, as promised.
      const auto acc = type == at::kDouble ? at::kDouble : (at::isIntegralType(type, false) ? at::kLong : at::kFloat);
      auto sum = at::zeros({n}, acc), mx = all[0].to(acc), mn = all[0].to(acc);
      for (const auto& t : all) {
        sum.add_(t.to(acc));
        mx = at::maximum(mx, t.to(acc));
        mn = at::minimum(mn, t.to(acc));
      }
      // Half a unit in the last place of partial sums up to ~16 is 2^-5 (bf16), 2^-8 (fp16).
      const double perRounding = type == at::kBFloat16 ? 0.03125 : 0.0039;
      const double tol = type == at::kBFloat16 || type == at::kHalf
                             ? (oneRounding ? (type == at::kBFloat16 ? 1e-2 : 1e-3) : perRounding * world)
                             : 1e-6;
      const auto close = [&](const at::Tensor& got, const at::Tensor& want) {
        return at::allclose(got.to(at::kDouble), want.to(type).to(at::kDouble), tol, tol);
      };

      auto out = at::empty({mine}, all[0].options());
      comm.reduceScatter(all[static_cast<std::size_t>(rank)], out, fw::ReduceOp::kSum).wait();
      EXPECT_TRUE(close(out, sum.narrow(0, offset, mine))) << "reduceScatter sum";
      if (at::isFloatingType(type)) {
        comm.reduceScatter(all[static_cast<std::size_t>(rank)], out, fw::ReduceOp::kAverage).wait();
        EXPECT_TRUE(close(out, sum.narrow(0, offset, mine).div(world))) << "reduceScatter average";
      }
      comm.reduceScatter(all[static_cast<std::size_t>(rank)], out, fw::ReduceOp::kMax).wait();
      EXPECT_TRUE(close(out, mx.narrow(0, offset, mine))) << "reduceScatter max";

      auto gathered = at::empty({n}, all[0].options());
      comm.allGather(all[static_cast<std::size_t>(rank)].narrow(0, offset, mine).contiguous(), gathered).wait();
      at::Tensor expectGather = at::empty({n}, all[0].options());
      for (int r = 0; r < world; ++r) {
        const auto o = offsets[static_cast<std::size_t>(r)];
        expectGather.narrow(0, o, counts[static_cast<std::size_t>(r)]).copy_(all[static_cast<std::size_t>(r)].narrow(0, o, counts[static_cast<std::size_t>(r)]));
      }
      EXPECT_TRUE(at::equal(gathered, expectGather)) << "allGather";

      auto reduced = all[static_cast<std::size_t>(rank)].clone();
      comm.allReduce(reduced, fw::ReduceOp::kSum).wait();
      EXPECT_TRUE(close(reduced, sum)) << "allReduce sum";
      auto smallest = all[static_cast<std::size_t>(rank)].clone();
      comm.allReduce(smallest, fw::ReduceOp::kMin).wait();
      EXPECT_TRUE(close(smallest, mn)) << "allReduce min";

      auto b = all[static_cast<std::size_t>(rank)].clone();
      comm.broadcast(b, world - 1).wait();
      EXPECT_TRUE(at::equal(b, all[static_cast<std::size_t>(world - 1)])) << "broadcast";
      comm.barrier().wait();
    }
  }
}


}  // namespace fsdp::testing
