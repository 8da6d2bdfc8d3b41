// What every communicator shares: how tensors are split over ranks, the checks made before
// anything is sent, and the Work of an operation that ran when issued.
#include "fsdp/worker/communicator.hpp"

#include <string>

#include "fsdp/common/error.hpp"

namespace fsdp::worker {

std::vector<std::int64_t> chunkSizes(std::int64_t total, int worldSize) {
  std::vector<std::int64_t> counts(static_cast<std::size_t>(worldSize), total / worldSize);
  for (std::int64_t r = 0; r < total % worldSize; ++r) ++counts[static_cast<std::size_t>(r)];
  return counts;
}

std::vector<std::int64_t> chunkOffsets(const std::vector<std::int64_t>& counts) {
  std::vector<std::int64_t> offsets(counts.size(), 0);
  for (std::size_t i = 1; i < counts.size(); ++i) offsets[i] = offsets[i - 1] + counts[i - 1];
  return offsets;
}

void checkSameType(const at::Tensor& a, const at::Tensor& b, const char* op) {
  if (a.scalar_type() != b.scalar_type()) {
    throw Error(std::string(op) + ": input is " + c10::toString(a.scalar_type()) + " but output is " +
                c10::toString(b.scalar_type()));
  }
}

std::vector<std::int64_t> checkGatherSizes(const at::Tensor& input, const at::Tensor& output, int rank, int size) {
  checkSameType(input, output, "allGather");
  auto counts = chunkSizes(output.numel(), size);
  const auto mine = counts[static_cast<std::size_t>(rank)];
  if (input.numel() != mine) {
    throw Error("allGather: input has " + std::to_string(input.numel()) + " elements, rank " +
                std::to_string(rank) + " must send " + std::to_string(mine) + " of the output's " +
                std::to_string(output.numel()));
  }
  return counts;
}

std::vector<std::int64_t> checkScatterSizes(const at::Tensor& input, const at::Tensor& output, int rank, int size) {
  checkSameType(input, output, "reduceScatter");
  auto counts = chunkSizes(input.numel(), size);
  const auto mine = counts[static_cast<std::size_t>(rank)];
  if (output.numel() != mine) {
    throw Error("reduceScatter: output has " + std::to_string(output.numel()) + " elements, rank " +
                std::to_string(rank) + " receives " + std::to_string(mine) + " of the input's " +
                std::to_string(input.numel()));
  }
  return counts;
}

Work completedWork(const std::function<void()>& fn) {
  std::promise<void> done;
  try {
    fn();
    done.set_value();
  } catch (...) {
    done.set_exception(std::current_exception());
  }
  return Work(done.get_future().share());
}

}  // namespace fsdp::worker
