// A process that saves sharded checkpoints back to back (one rank), for the test that kills it
// with SIGKILL at random points of a save; and the check that follows each kill.
//   ckpt_writer DIR save      save steps 1, 2, 3, ... until killed ("committed N" after each)
//   ckpt_writer DIR verify    load the newest complete checkpoint: "loaded N", exit 0; exit 3
//                             when there is none; exit 2 (with the reason) when it is refused
#include <ATen/Functions.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cstdio>
#include <iostream>

#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "fsdp/worker/checkpoint.hpp"
#include "fsdp/worker/gloo_communicator.hpp"
#include "fsdp/worker/runtime.hpp"

namespace {

using namespace std::chrono_literals;

int run(const std::string& dir, const std::string& mode) {
  fsdp::rendezvous::StoreServer server(fsdp::rendezvous::ServerOptions{});
  auto store = fsdp::rendezvous::StoreClient::connect("127.0.0.1", server.port(), {.timeout = 30s});
  auto comm = fsdp::worker::createGlooCommunicator(*store, {.rank = 0, .size = 1, .storePrefix = "w", .timeout = 30s});
  fsdp::Runtime rt(fsdp::WorkerEnv{}, std::move(store), std::move(comm));
  torch::manual_seed(1);
  torch::nn::Sequential net;
  for (int i = 0; i < 4; ++i) net->push_back(torch::nn::Linear(1024, 1024));  // 50 MB a checkpoint
  fsdp::FullyShardedDataParallel model(net, rt.comm(), {.autoWrap = fsdp::AutoWrapPolicy::minParams(1000)});
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  fsdp::Checkpointer ckpt(rt, {.dir = dir, .keep = 2});
  if (mode == "verify") {
    const auto progress = ckpt.loadLatest(model, &opt);
    if (!progress) return 3;
    std::printf("loaded %lld\n", static_cast<long long>(progress->step));
    return 0;
  }
  // Adam's state exists after a step; every save then writes parameters and both moments.
  opt.zero_grad();
  model->forward(at::randn({8, 1024})).sum().backward();
  opt.step();
  std::int64_t step = 0;
  if (const auto progress = ckpt.loadLatest(model, &opt)) step = progress->step;
  for (;;) {
    ++step;
    {
      at::NoGradGuard noGrad;
      for (auto& p : model->parameters()) p.add_(1e-3);
    }
    ckpt.save(model, &opt, {.step = step});
    std::printf("committed %lld\n", static_cast<long long>(step));
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: ckpt_writer DIR save|verify\n";
    return 2;
  }
  try {
    return run(argv[1], argv[2]);
  } catch (const fsdp::ConfigError& e) {
    std::cerr << "ckpt_writer: refused: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "ckpt_writer: " << e.what() << "\n";
    return 1;
  }
}
