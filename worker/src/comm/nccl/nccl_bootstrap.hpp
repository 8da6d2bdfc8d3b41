#pragma once
// Joining an NCCL group: the unique id through the store, then a non-blocking init, both under
// one deadline (the caller's timeout, not one each).

#include <memory>
#include <string>

#include "fsdp/common/deadline.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/worker/nccl_communicator.hpp"
#include "nccl_api.hpp"

namespace fsdp::worker::detail {

// Throws ConfigError when rank, size or prefix are inconsistent.
void checkNcclOptions(const NcclOptions& options);

// exchangeNcclUniqueId() with every wait bounded by `deadline`. Rank 0 removes its keys on
// every path, a failure included (a removal the store refuses is logged).
std::string exchangeUniqueId(rendezvous::StoreClient& store, const NcclOptions& options,
                             NcclApi& api, const Deadline& deadline);

// The id exchange, then ncclCommInitRankConfig (non-blocking) until it settled, both within
// `deadline`. Returns the communicator, owned by the caller. Throws what the exchange throws,
// TimeoutError when init did not settle in time, Error when it failed (the half-made
// communicator aborted in both cases).
NcclComm joinNcclGroup(rendezvous::StoreClient& store, const NcclOptions& options, NcclApi& api,
                       const Deadline& deadline);

// createNcclCommunicator() over `api`, within `deadline` (nccl_communicator.cpp).
std::unique_ptr<Communicator> createNcclCommunicator(rendezvous::StoreClient& store,
                                                     const NcclOptions& options,
                                                     std::shared_ptr<NcclApi> api,
                                                     const Deadline& deadline);

}  // namespace fsdp::worker::detail
