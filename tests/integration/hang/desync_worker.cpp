// A program with a desync bug, for the hang report: twelve collectives alternating all_reduce
// (10 floats) and all_gather (30 floats); the rank given by --skip_rank skips the fifth (an
// all_reduce), so from there on its operations no longer match its peers' at the same sequence
// number. Afterwards every rank blocks reading a pipe (its code went elsewhere); the peers that
// are one operation ahead wait in their last collective, and the job hangs.
#include <ATen/Functions.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "fsdp/worker/errors.hpp"
#include "fsdp/worker/runtime.hpp"

namespace {

int run(int skipRank) {
  auto rt = fsdp::init();
  const int size = rt->worldSize();
  for (int op = 1; op <= 12; ++op) {
    if (op == 5 && rt->rank() == skipRank) continue;  // the bug
    fsdp::CommTag tag("desync_worker", "op " + std::to_string(op));
    if (op % 2 == 1) {
      rt->comm().allReduce(at::ones({10})).wait();
    } else {
      rt->comm().allGather(at::ones({30 / size + (rt->rank() < 30 % size ? 1 : 0)}), at::empty({30})).wait();
    }
    fsdp::markProgress(op);
  }
  int fds[2];
  if (::pipe(fds) != 0) return 1;
  char byte;
  return static_cast<int>(::read(fds[0], &byte, 1));  // nobody writes
}

}  // namespace

int main(int argc, char** argv) {
  const int skipRank = argc > 2 && std::string(argv[1]) == "--skip_rank" ? std::atoi(argv[2]) : 1;
  return fsdp::worker::runMain("desync_worker", [&] { return run(skipRank); });
}
