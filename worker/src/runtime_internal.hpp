#pragma once
// What fsdp::init() and an in-process re-formation share (runtime.cpp, reform/reform.cpp).
// Private to libfsdp.

#include <memory>
#include <string>

#include "comm/nccl/nccl_bootstrap.hpp"
#include "fsdp/worker/runtime.hpp"

namespace fsdp::worker::detail {

// The round's communicators as fsdp::init() builds them: the backend chosen (chooseBackend),
// shared memory inside a node, Gloo across, NCCL with a Gloo group for CPU tensors.
struct Communicators {
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Communicator> cpuComm;  // nullptr: comm takes CPU tensors
  Backend backend = Backend::kGloo;
  std::string reason;  // why this backend, for the log line
};
// `ncclParent`: the last round's NCCL communicator of a re-formation (takeNcclParent), which
// this round shrinks where every rank holds it (nccl_bootstrap.hpp).
Communicators buildCommunicators(const WorkerEnv& env, rendezvous::StoreClient& store, const InitOptions& options,
                                 std::unique_ptr<NcclParent> ncclParent = nullptr);

// `inner` under a ReformableCommunicator (nullptr stays nullptr).
std::unique_ptr<Communicator> reformable(std::unique_ptr<Communicator> inner);

// Under an agent's control channel: the agent's abort notice aborts the runtime's communicators.
void enableReformation(Runtime& runtime);
void disableReformation(Runtime& runtime);

}  // namespace fsdp::worker::detail
