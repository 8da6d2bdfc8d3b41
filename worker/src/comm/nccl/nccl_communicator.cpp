// The NCCL communicator's front: input checks, the collectives mapped onto an NcclQueue
// (comm/nccl/nccl_queue.hpp), creation (comm/nccl/nccl_bootstrap.hpp), all over CUDA/NCCL through NcclApi
// (comm/nccl/nccl_api.hpp; the real one is comm/nccl/nccl_cuda_api.cpp, which also answers
// ncclAvailable() and cudaDeviceCount()).
#include "fsdp/worker/nccl_communicator.hpp"

#include "comm/nccl/nccl_api.hpp"
#include "comm/nccl/nccl_bootstrap.hpp"
#include "comm/nccl/nccl_queue.hpp"
#include "comm/recorded_communicator.hpp"
#include "fsdp/common/error.hpp"

namespace fsdp::worker {
namespace detail {
namespace {

std::string rankText(int rank, int size) {
  return "rank " + std::to_string(rank) + " of " + std::to_string(size);
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<NcclApi> api, NcclComm comm, CudaStream stream, void* scratch,
                   NcclOptions options)
      : api_(api),
        scratch_(scratch),
        options_(std::move(options)),
        queue_(std::make_unique<NcclQueue>(
            api, comm, stream,
            NcclQueueOptions{options_.rank, options_.size, options_.device, options_.timeout})) {}

  ~NcclCommunicator() override {
    queue_.reset();  // closes the communicator: nothing reads the scratch buffer after this
    api_->release(scratch_);
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  c10::DeviceType deviceType() const override { return c10::DeviceType::CUDA; }
  c10::Device device() const override {
    return {c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(options_.device)};
  }
  const char* backendName() const override { return "NCCL"; }

  bool abort(const std::string& why) override { return queue_->abort(why); }

  // The revoked communicator of an abort, for the next round's shrink.
  std::unique_ptr<NcclParent> takeParent() {
    const NcclComm comm = queue_->takeRevoked();
    if (comm == nullptr) return nullptr;
    return std::make_unique<NcclParent>(api_, comm, options_.rank, options_.size, options_.device,
                                        options_.storePrefix);
  }

  Work allReduce(at::Tensor tensor, ReduceOp op) override {
    check(tensor, "allReduce");
    return queue_->launch("allReduce", {tensor}, [&](NcclComm comm, CudaStream stream) {
      return api_->allReduce(tensor.data_ptr(), tensor.data_ptr(), count(tensor),
                             tensor.scalar_type(), ncclReduction(op, size()), comm, stream);
    });
  }

  Work allGather(at::Tensor input, at::Tensor output) override {
    check(input, "allGather");
    check(output, "allGather");
    checkSameType(input, output, "allGather");
    if (output.numel() != input.numel() * size()) {
      throw Error("allGather: the NCCL communicator needs equal chunks (output " +
                  std::to_string(output.numel()) + " = " + std::to_string(size()) + " x input " +
                  std::to_string(input.numel()) + "); FSDP pads its flat parameters so");
    }
    return queue_->launch("allGather", {input, output}, [&](NcclComm comm, CudaStream stream) {
      return api_->allGather(input.data_ptr(), output.data_ptr(), count(input), input.scalar_type(),
                             comm, stream);
    });
  }

  Work reduceScatter(at::Tensor input, at::Tensor output, ReduceOp op) override {
    check(input, "reduceScatter");
    check(output, "reduceScatter");
    checkSameType(input, output, "reduceScatter");
    if (input.numel() != output.numel() * size()) {
      throw Error("reduceScatter: the NCCL communicator needs equal chunks (input " +
                  std::to_string(input.numel()) + " = " + std::to_string(size()) + " x output " +
                  std::to_string(output.numel()) + ")");
    }
    return queue_->launch("reduceScatter", {input, output}, [&](NcclComm comm, CudaStream stream) {
      return api_->reduceScatter(input.data_ptr(), output.data_ptr(), count(output),
                                 input.scalar_type(), ncclReduction(op, size()), comm, stream);
    });
  }

  Work broadcast(at::Tensor tensor, int root) override {
    check(tensor, "broadcast");
    if (root < 0 || root >= size()) {
      throw Error("broadcast: root " + std::to_string(root) + " is not a rank of " +
                  std::to_string(size()));
    }
    return queue_->launch("broadcast", {tensor}, [&](NcclComm comm, CudaStream stream) {
      return api_->broadcast(tensor.data_ptr(), tensor.data_ptr(), count(tensor),
                             tensor.scalar_type(), root, comm, stream);
    });
  }

  // A one-element all-reduce on a buffer allocated once; the host waits for it (bounded by the
  // watchdog's deadline), as a barrier must.
  Work barrier() override {
    const Work issued = queue_->launch(
        "barrier", {},
        [&](NcclComm comm, CudaStream stream) {
          return api_->allReduce(scratch_, scratch_, 1, at::kFloat, ReduceOp::kSum, comm, stream);
        },
        WaitMode::kHost);
    issued.wait();  // throws when it failed
    return issued;
  }

 private:
  static std::size_t count(const at::Tensor& t) { return static_cast<std::size_t>(t.numel()); }

  void check(const at::Tensor& t, const char* op) const {
    if (!t.defined()) throw Error(std::string(op) + ": undefined tensor");
    if (!t.is_cuda()) {
      throw Error(std::string(op) + ": tensor on " + t.device().str() +
                  ", but the NCCL communicator takes CUDA tensors (use Gloo for CPU)");
    }
    if (t.device().index() != options_.device) {
      throw Error(std::string(op) + ": tensor on " + t.device().str() + ", but " +
                  rankText(rank(), size()) +
                  "'s NCCL communicator is on cuda:" + std::to_string(options_.device));
    }
    if (!t.is_contiguous()) throw Error(std::string(op) + ": tensor must be contiguous");
    if (!ncclSupports(t.scalar_type())) {
      throw Error(std::string(op) + ": dtype " + c10::toString(t.scalar_type()) +
                  " is not supported by the NCCL communicator");
    }
  }

  std::shared_ptr<NcclApi> api_;
  void* scratch_;
  NcclOptions options_;
  std::unique_ptr<NcclQueue> queue_;
};

}  // namespace

ReduceOp ncclReduction(ReduceOp op, int worldSize) {
  return worldSize == 1 && op == ReduceOp::kAverage ? ReduceOp::kSum : op;
}

std::unique_ptr<NcclParent> takeNcclParent(Communicator& comm) {
  auto* nccl = dynamic_cast<NcclCommunicator*>(&unrecorded(comm));
  return nccl != nullptr ? nccl->takeParent() : nullptr;
}

std::unique_ptr<Communicator> createNcclCommunicator(rendezvous::StoreClient& store,
                                                     const NcclOptions& options,
                                                     std::shared_ptr<NcclApi> api,
                                                     const Deadline& deadline,
                                                     std::unique_ptr<NcclParent> parent, bool announce) {
  checkNcclOptions(options);
  api->canShrink();  // a bad FSDP_NCCL_SHRINK is refused here, not in an abort
  const std::string who =
      rankText(options.rank, options.size) + " (cuda:" + std::to_string(options.device) + ")";
  const int devices = api->deviceCount();
  if (options.device < 0 || options.device >= devices) {
    throw ConfigError("NCCL communicator on " + who + ": " + std::to_string(devices) +
                      " CUDA device(s) visible to this process");
  }
  // NCCL takes the calling thread's current device for the communicator's.
  if (const auto r = api->setDevice(options.device); !r.isDone()) {
    throw Error("NCCL communicator on " + who + ": cudaSetDevice: " + r.cause);
  }
  if (parent != nullptr && parent->device != options.device) parent.reset();
  const NcclComm comm = joinNcclGroup(store, options, *api, deadline, std::move(parent), announce);
  const auto stream = api->createStream();
  const auto scratch = stream.result.isDone() ? api->allocate(sizeof(float)) : Made<void*>{};
  if (!stream.result.isDone() || !scratch.result.isDone()) {
    api->commAbort(comm);
    if (stream.result.isDone()) api->destroyStream(stream.handle);
    throw Error("NCCL communicator on " + who + ": " +
                (stream.result.isDone() ? "cudaMalloc: " + scratch.result.cause
                                        : "cudaStreamCreate: " + stream.result.cause));
  }
  return std::make_unique<NcclCommunicator>(api, comm, stream.handle, scratch.handle, options);
}

}  // namespace detail

std::string exchangeNcclUniqueId(rendezvous::StoreClient& store, const NcclOptions& options) {
  detail::checkNcclOptions(options);
  return detail::exchangeUniqueId(store, options, *detail::cudaNcclApi(),
                                  Deadline::after(options.timeout));
}

// One deadline, taken here, bounds the unique-id exchange and the initialisation together.
std::unique_ptr<Communicator> createNcclCommunicator(rendezvous::StoreClient& store,
                                                     const NcclOptions& options) {
  detail::checkNcclOptions(options);
  return detail::createNcclCommunicator(store, options, detail::cudaNcclApi(),
                                        Deadline::after(options.timeout));
}

}  // namespace fsdp::worker
