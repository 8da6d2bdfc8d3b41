// A worker for the shared-memory kill test: on the first attempt it writes <dir>/<rank>.pid
// and all-reduces 16 MB tensors in a loop until a peer dies (the test kills rank 1 with
// SIGKILL once <dir>/<rank>.looping exists), then reports the error it got in <dir>/error.<rank>
// and fails; on the restart it checks one all-reduce and prints "restart ok" with the backend.
//
//   shm_kill_worker <dir>
#include <unistd.h>

#include <csignal>

#include <ATen/Functions.h>

#include <fstream>
#include <iostream>
#include <string>

#include "fsdp/common/error.hpp"
#include "fsdp/worker/errors.hpp"
#include "fsdp/worker/runtime.hpp"

namespace {

int run(const std::string& dir) {
  using namespace std::chrono_literals;
  auto rt = fsdp::init({.timeout = 60s});
  const int rank = rt->rank();
  if (rt->env().restartCount > 0) {
    auto t = at::full({1000}, static_cast<float>(rank + 1));
    rt->comm().allReduce(t).wait();
    const float want = rt->worldSize() * (rt->worldSize() + 1) / 2.0F;
    if (t.min().item<float>() != want || t.max().item<float>() != want) return 10;
    std::cout << "restart ok rank " << rank << " backend " << rt->comm().backendName() << std::endl;
    return 0;
  }
  // Rank 0 ignores fsdprun's SIGTERM (sent when rank 1 dies), so that it is the communicator
  // that notices the death, as it must when the agent is slow or gone.
  if (rank == 0) ::signal(SIGTERM, SIG_IGN);
  std::ofstream(dir + "/" + std::to_string(rank) + ".pid") << ::getpid() << '\n';
  auto t = at::ones({4L << 20});
  try {
    for (int i = 0; i < 1000000; ++i) {
      rt->comm().allReduce(t, fsdp::ReduceOp::kAverage).wait();
      if (i == 0) std::ofstream(dir + "/" + std::to_string(rank) + ".looping") << "1\n";
    }
  } catch (const fsdp::Error& e) {
    std::ofstream(dir + "/error." + std::to_string(rank)) << e.what() << '\n';
    throw;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::runMain("shm_kill_worker", [&] {
    if (argc != 2) throw fsdp::ConfigError("usage: shm_kill_worker <dir>");
    return run(argv[1]);
  });
}
