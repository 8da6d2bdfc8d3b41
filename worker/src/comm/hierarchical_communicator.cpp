// The world over several nodes: a communicator inside each node (shared memory) and one across
// nodes for each local rank (Gloo). See hierarchical_communicator.hpp.
#include "fsdp/worker/hierarchical_communicator.hpp"

#include <ATen/Functions.h>

#include "fsdp/common/error.hpp"

namespace fsdp::worker {
namespace {

class HierarchicalCommunicator final : public Communicator {
 public:
  HierarchicalCommunicator(std::unique_ptr<Communicator> local, std::unique_ptr<Communicator> cross)
      : local_(std::move(local)), cross_(std::move(cross)) {}

  int rank() const override { return node() * localSize() + localRank(); }
  int size() const override { return localSize() * nodes(); }
  c10::DeviceType deviceType() const override { return local_->deviceType(); }
  const char* backendName() const override { return "shared memory + Gloo"; }
  bool abort(const std::string& why) override {
    const bool inside = local_->abort(why);
    const bool across = cross_->abort(why);
    return inside && across;
  }

  Work allReduce(at::Tensor tensor, ReduceOp op) override {
    checkContiguous(tensor, "allReduce");
    return completedWork([&] {
      // Inside the node to one chunk per local rank, that chunk across nodes, back inside.
      const auto flat = tensor.view({-1});
      const auto counts = chunkSizes(flat.numel(), localSize());
      auto mine = at::empty({counts[static_cast<std::size_t>(localRank())]}, flat.options());
      const ReduceOp inner = op == ReduceOp::kAverage ? ReduceOp::kSum : op;
      local_->reduceScatter(flat, mine, inner).wait();
      cross_->allReduce(mine, inner).wait();
      if (op == ReduceOp::kAverage) mine.div_(size());
      local_->allGather(mine, flat).wait();
    });
  }

  // Padded to equal chunks of c = ceil(n / world) elements, permuted so that what each local
  // rank reduces inside the node is contiguous: local rank l gets the node's sum of the chunks
  // of ranks (j * L + l) for every node j, then reduces its own one across nodes.
  Work reduceScatter(at::Tensor input, at::Tensor output, ReduceOp op) override {
    checkContiguous(input, "reduceScatter");
    checkContiguous(output, "reduceScatter");
    const auto counts = checkScatterSizes(input, output, rank(), size());
    return completedWork([&] {
      const std::int64_t c = counts.front();
      const auto flat = input.view({-1});
      auto permuted = at::zeros({c * size()}, flat.options());
      const auto offsets = chunkOffsets(counts);
      for (int r = 0; r < size(); ++r) {
        const auto n = counts[static_cast<std::size_t>(r)];
        permuted.narrow(0, permutedAt(r, c), n).copy_(flat.narrow(0, offsets[static_cast<std::size_t>(r)], n));
      }
      const ReduceOp inner = op == ReduceOp::kAverage ? ReduceOp::kSum : op;
      auto nodeSums = at::empty({c * nodes()}, flat.options());
      local_->reduceScatter(permuted, nodeSums, inner).wait();
      auto mine = at::empty({c}, flat.options());
      cross_->reduceScatter(nodeSums, mine, inner).wait();
      if (op == ReduceOp::kAverage) mine.div_(size());
      output.view({-1}).copy_(mine.narrow(0, 0, output.numel()));
    });
  }

  // The reverse: this rank's chunk across nodes (padded to c), then inside the node, then the
  // chunks put back in rank order.
  Work allGather(at::Tensor input, at::Tensor output) override {
    checkContiguous(input, "allGather");
    checkContiguous(output, "allGather");
    const auto counts = checkGatherSizes(input, output, rank(), size());
    return completedWork([&] {
      const std::int64_t c = counts.front();
      auto mine = at::zeros({c}, input.options());
      mine.narrow(0, 0, input.numel()).copy_(input.view({-1}));
      auto acrossNodes = at::empty({c * nodes()}, input.options());
      cross_->allGather(mine, acrossNodes).wait();
      auto permuted = at::empty({c * size()}, input.options());
      local_->allGather(acrossNodes, permuted).wait();
      const auto flat = output.view({-1});
      const auto offsets = chunkOffsets(counts);
      for (int r = 0; r < size(); ++r) {
        const auto n = counts[static_cast<std::size_t>(r)];
        flat.narrow(0, offsets[static_cast<std::size_t>(r)], n).copy_(permuted.narrow(0, permutedAt(r, c), n));
      }
    });
  }

  Work broadcast(at::Tensor tensor, int root) override {
    checkContiguous(tensor, "broadcast");
    if (root < 0 || root >= size()) {
      throw Error("broadcast: root " + std::to_string(root) + " is not a rank of 0.." + std::to_string(size() - 1));
    }
    return completedWork([&] {
      // Across nodes among the root's local rank, then inside every node from it.
      if (localRank() == root % localSize()) cross_->broadcast(tensor, root / localSize()).wait();
      local_->broadcast(tensor, root % localSize()).wait();
    });
  }

  Work barrier() override {
    return completedWork([&] {
      local_->barrier().wait();
      cross_->barrier().wait();
      local_->barrier().wait();
    });
  }

 private:
  int localRank() const { return local_->rank(); }
  int localSize() const { return local_->size(); }
  int node() const { return cross_->rank(); }
  int nodes() const { return cross_->size(); }

  static void checkContiguous(const at::Tensor& t, const char* op) {
    if (!t.defined()) throw Error(std::string(op) + ": undefined tensor");
    if (!t.is_contiguous()) throw Error(std::string(op) + ": tensor must be contiguous");
  }

  // Where rank r's chunk (of c elements) lies in the layout that makes each local rank's share
  // contiguous: local rank major, then node.
  std::int64_t permutedAt(int r, std::int64_t c) const {
    return (static_cast<std::int64_t>(r % localSize()) * nodes() + r / localSize()) * c;
  }

  std::unique_ptr<Communicator> local_;
  std::unique_ptr<Communicator> cross_;
};

}  // namespace

std::unique_ptr<Communicator> makeHierarchicalCommunicator(std::unique_ptr<Communicator> local,
                                                           std::unique_ptr<Communicator> cross) {
  if (!local || !cross) throw ConfigError("hierarchical communicator: both levels are needed");
  if (local->deviceType() != cross->deviceType()) {
    throw ConfigError(std::string("hierarchical communicator: the node's ") + local->backendName() +
                      " and the cross-node " + cross->backendName() + " take tensors on different devices");
  }
  return std::make_unique<HierarchicalCommunicator>(std::move(local), std::move(cross));
}

}  // namespace fsdp::worker
