// A worker for the NCCL unique-id test: it runs the exchange createNcclCommunicator runs (real
// ncclGetUniqueId on rank 0, the id through the store under the round), writes the 128 bytes in
// hex to <out>/round<R>.rank<N>, checks that the key is gone once every rank read it, and on
// the first attempt makes rank --fail_rank exit 1 so that fsdprun restarts the group.
//
//   nccl_id_worker <out> [--fail_rank R]
//   nccl_id_worker --init_only     fsdp::init() as a program would call it (FSDPRUN_BACKEND
//                                  decides), then prints the backend and its device
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

#include "fsdp/common/error.hpp"
#include "fsdp/worker/errors.hpp"
#include "fsdp/worker/nccl_communicator.hpp"
#include "fsdp/worker/runtime.hpp"

namespace {

std::string hex(const std::string& bytes) {
  std::string out;
  char digits[3];
  for (const unsigned char c : bytes) {
    std::snprintf(digits, sizeof digits, "%02x", c);
    out += digits;
  }
  return out;
}

int run(int argc, char** argv) {
  if (argc < 2) throw fsdp::ConfigError("usage: nccl_id_worker <out> [--fail_rank R] | --init_only");
  const std::string out = argv[1];
  if (out == "--init_only") {
    auto rt = fsdp::init();
    rt->comm().barrier().wait();
    std::cout << "rank " << rt->rank() << " backend " << rt->comm().backendName() << " on "
              << rt->device().str() << ", cpu group " << rt->cpuComm().backendName() << std::endl;
    return 0;
  }
  const int failRank = argc >= 4 && std::string(argv[2]) == "--fail_rank" ? std::atoi(argv[3]) : -1;
  using namespace std::chrono_literals;
  // Gloo for the barriers (what fsdp::init() picks on a machine without a GPU).
  auto rt = fsdp::init({.timeout = 60s, .backend = fsdp::Backend::kGloo});
  const std::string prefix = rt->roundPrefix() + "nccl/world";
  const std::string id = fsdp::worker::exchangeNcclUniqueId(
      rt->store(), {.rank = rt->rank(), .size = rt->worldSize(), .storePrefix = prefix, .timeout = 60s});
  {
    std::ofstream file(out + "/round" + std::to_string(rt->env().round) + ".rank" + std::to_string(rt->rank()));
    file << hex(id) << '\n';
  }
  rt->comm().barrier().wait();
  // Rank 0 returned only after every rank read the id and the key was deleted.
  if (rt->store().check({prefix + "/unique_id"})) {
    std::cerr << "nccl_id_worker: " << prefix << "/unique_id is still in the store after every rank read it\n";
    return 11;
  }
  if (rt->env().round > 0 && rt->store().check({fsdp::Runtime::roundPrefixFor(rt->env().round - 1) + "nccl/world/unique_id"})) {
    std::cerr << "nccl_id_worker: the previous round's unique id is still in the store\n";
    return 12;
  }
  rt->comm().barrier().wait();
  if (rt->env().restartCount == 0 && rt->rank() == failRank) {
    std::cerr << "nccl_id_worker: rank " << failRank << " fails on purpose to force a restart\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::runMain("nccl_id_worker", [&] { return run(argc, argv); });
}
