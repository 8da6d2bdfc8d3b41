#pragma once
// Joining an NCCL group: the unique id through the store, then a non-blocking init, both under
// one deadline (the caller's timeout, not one each); or, where every rank of a re-formed round
// holds the last round's communicator (revoked by the abort) and the world only shrank, that
// communicator shrunk to them (ncclCommShrink, NCCL 2.28+), with no new bootstrap.

#include <memory>
#include <string>
#include <vector>

#include "fsdp/common/deadline.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/worker/nccl_communicator.hpp"
#include "nccl_api.hpp"

namespace fsdp::worker::detail {

// The last round's communicator of this process, revoked (NcclQueue::takeRevoked), which the
// next may shrink. Aborted when it goes, shrunk or not.
struct NcclParent {
  NcclParent(std::shared_ptr<NcclApi> api, NcclComm comm, int rank, int size, int device, std::string storePrefix);
  ~NcclParent();
  NcclParent(const NcclParent&) = delete;
  NcclParent& operator=(const NcclParent&) = delete;

  const std::shared_ptr<NcclApi> api;
  const NcclComm comm;
  const int rank, size, device;
  const std::string storePrefix;  // the round's that made it: one communicator, one prefix
};

// What the ranks of a group agree on: a new communicator from `uniqueId`, or (uniqueId empty)
// the shrink of the parent they all hold, leaving out its ranks in `exclude`.
struct NcclPlan {
  std::string uniqueId;
  std::vector<int> exclude;
  bool shrinks() const { return uniqueId.empty(); }
};

// Throws ConfigError when rank, size or prefix are inconsistent.
void checkNcclOptions(const NcclOptions& options);

// exchangeNcclUniqueId() with every wait bounded by `deadline`. Rank 0 removes its keys on
// every path, a failure included (a removal the store refuses is logged).
std::string exchangeUniqueId(rendezvous::StoreClient& store, const NcclOptions& options,
                             NcclApi& api, const Deadline& deadline);

// The exchange of a round after the first (`announce`): every rank but 0 posts, under the
// prefix, whether it holds a parent (its rank and size in it, the parent's prefix); rank 0, when
// it holds one, reads them all and publishes a shrink where every rank holds the same parent,
// they keep their order (the new rank r is the r-th survivor) and at least one rank was left
// out; else a unique id, as exchangeUniqueId(). Rank 0 removes every key it read or wrote, on
// every path. A rank told to shrink without a parent throws ProtocolError.
NcclPlan exchangePlan(rendezvous::StoreClient& store, const NcclOptions& options, NcclApi& api,
                      const Deadline& deadline, const NcclParent* parent, bool announce);

// The plan's exchange, then ncclCommInitRankConfig or ncclCommShrink (non-blocking) until it
// settled, both within `deadline`. Returns the communicator, owned by the caller; `parent` is
// aborted before an init and after a shrink. Throws what the exchange throws, TimeoutError when
// the init or shrink did not settle in time, Error when it failed (the half-made communicator
// aborted in both cases).
NcclComm joinNcclGroup(rendezvous::StoreClient& store, const NcclOptions& options, NcclApi& api,
                       const Deadline& deadline, std::unique_ptr<NcclParent> parent = nullptr,
                       bool announce = false);

// createNcclCommunicator() over `api`, within `deadline`, from `parent` where the round allows
// (nccl_communicator.cpp).
std::unique_ptr<Communicator> createNcclCommunicator(rendezvous::StoreClient& store,
                                                     const NcclOptions& options,
                                                     std::shared_ptr<NcclApi> api,
                                                     const Deadline& deadline,
                                                     std::unique_ptr<NcclParent> parent = nullptr,
                                                     bool announce = false);

// What an NCCL communicator made here holds after an abort on a library that shrinks (unwrapping
// the recorder): its revoked communicator as a parent for the next round; nullptr otherwise,
// for any other communicator.
std::unique_ptr<NcclParent> takeNcclParent(Communicator& comm);

}  // namespace fsdp::worker::detail
