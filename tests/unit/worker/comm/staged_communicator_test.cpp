// The CPU world staged through another communicator (comm/nccl/staged_communicator.hpp), as a
// job over several nodes runs it under NCCL where libfsdp has no Gloo. Here the communicator it
// stages through is shared memory on the CPU, behind a wrapper that holds it to NCCL's contract
// (contiguous tensors, equal chunks): every operation, dtype and uneven size must still equal the
// local result, and the caller's tensors must be written only with the result.
#include "comm/nccl/staged_communicator.hpp"

#include <gtest/gtest.h>

#include <future>

#include "communicator_checks.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "fsdp/worker/shm_communicator.hpp"

namespace {

using namespace std::chrono_literals;
namespace fw = fsdp::worker;

// NCCL's contract around another communicator: a tensor that is not contiguous, or chunks that
// are not equal, is refused, as the NCCL communicator refuses them.
class EqualChunksOnly final : public fw::Communicator {
 public:
  explicit EqualChunksOnly(std::unique_ptr<fw::Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  c10::DeviceType deviceType() const override { return inner_->deviceType(); }
  const char* backendName() const override { return "equal chunks"; }
  bool abort(const std::string& why) override {
    aborted = why;
    return inner_->abort(why);
  }
  fw::Work allReduce(at::Tensor t, fw::ReduceOp op) override { return inner_->allReduce(contiguous(t), op); }
  fw::Work broadcast(at::Tensor t, int root) override { return inner_->broadcast(contiguous(t), root); }
  fw::Work barrier() override { return inner_->barrier(); }
  fw::Work allGather(at::Tensor in, at::Tensor out) override {
    if (out.numel() != in.numel() * size()) throw fsdp::Error("allGather: unequal chunks");
    return inner_->allGather(contiguous(in), contiguous(out));
  }
  fw::Work reduceScatter(at::Tensor in, at::Tensor out, fw::ReduceOp op) override {
    if (in.numel() != out.numel() * size()) throw fsdp::Error("reduceScatter: unequal chunks");
    return inner_->reduceScatter(contiguous(in), contiguous(out), op);
  }
  std::string aborted;

 private:
  static at::Tensor contiguous(at::Tensor t) {
    if (!t.is_contiguous()) throw fsdp::Error("not contiguous");
    return t;
  }
  std::unique_ptr<fw::Communicator> inner_;
};

void runStaged(int world, const std::function<void(fw::Communicator&, EqualChunksOnly&, int)>& body) {
  fsdp::rendezvous::StoreServer server(fsdp::rendezvous::ServerOptions{});
  std::vector<std::future<void>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::async(std::launch::async, [&, r] {
      auto store = fsdp::rendezvous::StoreClient::connect("127.0.0.1", server.port(), {.timeout = 30s});
      auto inner = std::make_unique<EqualChunksOnly>(fw::createShmCommunicator(
          *store, {.rank = r, .size = world, .storePrefix = "staged", .runId = "staged-test", .timeout = 30s}));
      auto& device = *inner;
      auto comm = fw::detail::makeStagedCommunicator(std::move(inner));
      body(*comm, device, r);
    }));
  }
  for (auto& f : ranks) f.wait();
  for (auto& f : ranks) f.get();
}

class StagedWorld : public ::testing::TestWithParam<int> {};

TEST_P(StagedWorld, EveryOperationEqualsTheLocalResultForEveryDtypeAndUnevenSizes) {
  const int world = GetParam();
  runStaged(world, [&](fw::Communicator& comm, EqualChunksOnly&, int rank) {
    ASSERT_EQ(comm.rank(), rank);
    ASSERT_EQ(comm.size(), world);
    EXPECT_EQ(comm.deviceType(), c10::DeviceType::CPU);
    EXPECT_STREQ(comm.backendName(), "equal chunks (CPU tensors staged)");
    fsdp::testing::checkEveryOperation(comm, rank, world);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, StagedWorld, ::testing::Values(1, 2, 3, 4));

// A tensor that is not contiguous (a column of a matrix) is reduced and broadcast in place; an
// abort reaches the communicator underneath; a tensor on another device is refused by name.
TEST(StagedCommunicator, NonContiguousTensorsAreWrittenInPlaceAndAnAbortGoesThrough) {
  runStaged(3, [](fw::Communicator& comm, EqualChunksOnly& device, int rank) {
    auto matrix = at::full({4, 3}, static_cast<double>(rank + 1), at::kDouble);
    auto column = matrix.select(1, 1);
    ASSERT_FALSE(column.is_contiguous());
    comm.allReduce(column, fw::ReduceOp::kSum).wait();
    EXPECT_TRUE(at::equal(matrix.select(1, 1), at::full({4}, 6.0, at::kDouble)));
    EXPECT_TRUE(at::equal(matrix.select(1, 0), at::full({4}, static_cast<double>(rank + 1), at::kDouble)));
    auto row = at::arange(12, at::kLong).view({3, 4}).mul(rank + 1).t();  // not contiguous
    comm.broadcast(row, 2).wait();
    EXPECT_TRUE(at::equal(row, at::arange(12, at::kLong).view({3, 4}).mul(3).t()));
    comm.barrier().wait();
    EXPECT_TRUE(device.aborted.empty());
    comm.abort("test: the round ended");
    EXPECT_EQ(device.aborted, "test: the round ended");
  });
}

TEST(StagedCommunicator, NothingToStageThroughIsRefused) {
  EXPECT_THROW(fw::detail::makeStagedCommunicator(nullptr), fsdp::Error);
}

}  // namespace
