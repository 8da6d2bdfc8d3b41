#pragma once
// CPU collectives over a communicator of another device: each CPU tensor is copied to that
// communicator's device, the collective runs there, the result is copied back before the call
// returns. Uneven chunks (which NCCL refuses) are padded to equal ones and put back in place.
//
// The CPU world of a job over several nodes whose libfsdp has no Gloo (a LibTorch with its own
// Gloo, as PyTorch's wheels: glooUnavailableReason()) runs over a second NCCL communicator this
// way. It carries a few numbers a step or a checkpoint (the Trainer's sums, a checkpoint's pick,
// the snapshots' agreement), where a copy each way costs nothing next to the collective.
#include <memory>

#include "fsdp/worker/communicator.hpp"

namespace fsdp::worker::detail {

// Takes CPU tensors of any layout the CPU communicators take; `device` gets contiguous tensors
// of equal chunks on its own device. Its name: "<device's name> (CPU tensors staged)".
std::unique_ptr<Communicator> makeStagedCommunicator(std::unique_ptr<Communicator> device);

}  // namespace fsdp::worker::detail
