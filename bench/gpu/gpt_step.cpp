// fsdp-gpu-bench: gpt training steps under our FSDP against plain LibTorch, in one process on
// one device, same model, same batches, same run. One JSON line per (mode, precision):
// step time, tokens/s, MFU against the card's bf16 dense peak, peak device memory, card name.
//
// On one GPU FSDP runs at world size 1 over a real NCCL communicator (NCCL refuses two ranks on
// one device); on a CPU (no CUDA LibTorch or no device) over a one-rank shared-memory
// communicator, so that the program itself is exercised everywhere. The store is a real
// rendezvous server on loopback, as in the tests.
//
//   fsdp-gpu-bench [--steps N] [--warmup N] [--batch N] [--block N] [--n_layer N] [--n_head N]
//                  [--n_embd N] [--precisions fp32,bf16] [--peak_tflops X]
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <CLI/CLI.hpp>
#include <c10/core/DeviceGuard.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <chrono>
#include <iostream>
#include <sstream>

#include "../../examples/gpt/model.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "fsdp/worker/errors.hpp"
#include "fsdp/worker/fsdp.hpp"
#include "fsdp/worker/nccl_communicator.hpp"
#include "fsdp/worker/shm_communicator.hpp"

// Only a CUDA LibTorch has the generated macros header (the same test as the NCCL communicator's).
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#define FSDP_BENCH_TORCH_CUDA 1
#else
#define FSDP_BENCH_TORCH_CUDA 0
#endif

namespace {

using Clock = std::chrono::steady_clock;
namespace fw = fsdp::worker;

struct Flags {
  int steps = 30;
  int warmup = 5;
  // GPT-2 small's shape (12 layers, 12 heads, width 768) on 512-token windows.
  std::int64_t batch = 16;
  std::int64_t block = 512;
  std::int64_t nLayer = 12;
  std::int64_t nHead = 12;
  std::int64_t nEmbd = 768;
  std::vector<std::string> precisions{"fp32", "bf16"};
  double peakTflops = 0;  // 0: from the card's name
};

bool onCuda() { return at::hasCUDA() && torch::cuda::device_count() > 0; }

std::string deviceName() {
#if FSDP_BENCH_TORCH_CUDA
  if (onCuda()) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, 0) == cudaSuccess) return p.name;
  }
#endif
  return "cpu";
}

// Dense bf16 tensor-core peak of the card, TFLOP/s (NVIDIA's data sheets, without sparsity).
double peakFor(const std::string& name) {
  if (name.find("H100") != std::string::npos || name.find("H200") != std::string::npos) {
    return name.find("PCIe") != std::string::npos ? 756.0 : 989.4;
  }
  if (name.find("A100") != std::string::npos) return 312.0;
  return 0;
}

void resetPeak() {
#if FSDP_BENCH_TORCH_CUDA
  if (onCuda()) {
    // LibTorch 2.x sets its caching allocator up at the first CUDA allocation; its statistics
    // calls before that throw "Invalid device argument" (seen on an H200 with 2.11).
    (void)at::empty({1}, at::TensorOptions().device(at::kCUDA, 0));
    c10::cuda::CUDACachingAllocator::emptyCache();
    c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  }
#endif
}

// Peak bytes allocated by LibTorch's caching allocator on device 0 since resetPeak() (-1 on CPU).
double peakMib() {
#if FSDP_BENCH_TORCH_CUDA
  if (onCuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    return static_cast<double>(stats.allocated_bytes[0].peak) / 1048576.0;
  }
#endif
  return -1;
}

void sync() {
  if (onCuda()) torch::cuda::synchronize();
}

struct Result {
  double stepMs = 0;
  double finalLoss = 0;
  double peakMib = -1;
};

// Trains `net` for warmup + steps on fixed random batches; the time is the mean of the timed steps.
template <typename Forward>
Result train(Forward forward, std::vector<at::Tensor> params, const Flags& f, const fsdp::examples::GptConfig& c,
             at::Device device) {
  torch::optim::AdamW opt(std::move(params), torch::optim::AdamWOptions(3e-4).weight_decay(0.01));
  const auto gen = at::detail::createCPUGenerator(1234);
  const auto data = at::randint(c.vocabSize, {8, f.batch, c.blockSize + 1}, gen, at::kLong).to(device);
  Result r;
  Clock::time_point start;
  for (int step = 0; step < f.warmup + f.steps; ++step) {
    if (step == f.warmup) {
      sync();
      start = Clock::now();
    }
    const auto batch = data[step % 8];
    const at::Tensor x = batch.narrow(1, 0, c.blockSize), y = batch.narrow(1, 1, c.blockSize);
    opt.zero_grad();
    const at::Tensor logits = forward(x).to(at::kFloat);
    const at::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, c.vocabSize}), y.reshape({-1}));
    loss.backward();
    opt.step();
    if (step + 1 == f.warmup + f.steps) r.finalLoss = loss.item<double>();
  }
  sync();
  r.stepMs = std::chrono::duration<double, std::milli>(Clock::now() - start).count() / f.steps;
  r.peakMib = peakMib();
  return r;
}

int run(const Flags& f) {
  const bool cuda = onCuda();
  const at::Device device = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const c10::DeviceGuard guard(device);
  const fsdp::examples::GptConfig config{.vocabSize = 256, .blockSize = f.block, .nLayer = f.nLayer,
                                         .nHead = f.nHead, .nEmbd = f.nEmbd};
  const std::string card = deviceName();
  const double peak = f.peakTflops > 0 ? f.peakTflops : peakFor(card);
  fsdp::rendezvous::StoreServer server(fsdp::rendezvous::ServerOptions{});
  auto store = fsdp::rendezvous::StoreClient::connect("127.0.0.1", server.port(), {});
  std::unique_ptr<fw::Communicator> comm =
      cuda ? fw::createNcclCommunicator(*store, {.rank = 0, .size = 1, .device = 0, .storePrefix = "nccl"})
           : fw::createShmCommunicator(*store, {.rank = 0, .size = 1, .storePrefix = "shm", .runId = "gpu-bench"});
  for (const auto& precision : f.precisions) {
    const bool bf16 = precision == "bf16";
    const auto make = [&] {
      torch::manual_seed(7);
      auto net = fsdp::examples::makeGpt(config);
      net->to(device);
      return net;
    };
    std::int64_t numParams = 0;
    // Plain LibTorch: fp32, or every parameter in bf16 (LibTorch's C++ API has no autocast that
    // is the same in 1.13 and 2.x; FSDP's bf16 keeps fp32 master shards, which this does not).
    resetPeak();
    auto plainNet = make();
    for (const auto& p : plainNet->parameters()) numParams += p.numel();
    if (bf16) plainNet->to(at::kBFloat16);
    const Result plain = train([&](const at::Tensor& x) { return plainNet->forward(x); }, plainNet->parameters(), f,
                               config, device);
    plainNet = nullptr;
    resetPeak();
    fw::FullyShardedDataParallel model(
        make(), *comm,
        {.autoWrap = fw::AutoWrapPolicy::byTypeName({"Block"}),
         .mixedPrecision = fw::MixedPrecision::parse(bf16 ? "bf16" : "no")});
    const Result ours = train([&](const at::Tensor& x) { return model->forward(x); }, model->parameters(), f, config,
                              device);
    // FLOPs of one training step: 6 per parameter per token, plus attention's 12 * layers *
    // context * width per token (PaLM's appendix B accounting).
    const double tokens = static_cast<double>(f.batch * f.block);
    const double flops = tokens * (6.0 * static_cast<double>(numParams) +
                                   12.0 * static_cast<double>(f.nLayer * f.block * f.nEmbd));
    for (const auto& [mode, r] : {std::pair{"plain_libtorch", plain}, std::pair{"fsdp_full_shard", ours}}) {
      const double tflops = flops / (r.stepMs / 1000.0) / 1e12;
      std::cout << nlohmann::json{{"bench", "gpu_gpt"},
                                  {"device", card},
                                  {"mode", mode},
                                  {"precision", bf16 && std::string(mode) == "plain_libtorch" ? "bf16_params" : precision},
                                  {"world_size", 1},
                                  {"backend", std::string(mode) == "plain_libtorch" ? "-" : comm->backendName()},
                                  {"parameters", numParams},
                                  {"batch", f.batch},
                                  {"block", f.block},
                                  {"steps", f.steps},
                                  {"step_ms", r.stepMs},
                                  {"tokens_per_s", tokens / (r.stepMs / 1000.0)},
                                  {"tflops", tflops},
                                  {"mfu", peak > 0 ? nlohmann::json(tflops / peak) : nlohmann::json(nullptr)},
                                  {"peak_tflops_bf16", peak > 0 ? nlohmann::json(peak) : nlohmann::json(nullptr)},
                                  {"peak_memory_mib", r.peakMib >= 0 ? nlohmann::json(r.peakMib) : nlohmann::json(nullptr)},
                                  {"final_loss", r.finalLoss}}
                       .dump()
                << std::endl;
    }
    std::cout << nlohmann::json{{"bench", "gpu_gpt"}, {"precision", precision},
                                {"fsdp_over_plain_step_time", ours.stepMs / plain.stepMs}}
                     .dump()
              << std::endl;
  }
  comm->barrier().wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gpt training steps under FSDP against plain LibTorch on one device (JSON lines)"};
  Flags f;
  std::string precisions = "fp32,bf16";
  app.add_option("--steps", f.steps, "timed steps")->check(CLI::Range(1, 100000));
  app.add_option("--warmup", f.warmup, "untimed steps first")->check(CLI::Range(0, 100000));
  app.add_option("--batch", f.batch, "sequences per step")->check(CLI::Range(1, 1 << 20));
  app.add_option("--block", f.block, "tokens per sequence")->check(CLI::Range(1, 1 << 20));
  app.add_option("--n_layer", f.nLayer)->check(CLI::Range(1, 1024));
  app.add_option("--n_head", f.nHead)->check(CLI::Range(1, 1024));
  app.add_option("--n_embd", f.nEmbd)->check(CLI::Range(1, 1 << 16));
  app.add_option("--precisions", precisions, "comma-separated: fp32, bf16");
  app.add_option("--peak_tflops", f.peakTflops, "the card's bf16 dense peak (default: from its name)");
  try {
    app.parse(argc, argv);
    f.precisions.clear();
    std::stringstream in(precisions);
    for (std::string p; std::getline(in, p, ',');) {
      if (p != "fp32" && p != "bf16") throw CLI::ValidationError("--precisions", "'" + p + "': expected fp32 or bf16");
      f.precisions.push_back(p);
    }
    if (f.nEmbd % f.nHead != 0) {
      throw CLI::ValidationError("--n_embd", std::to_string(f.nEmbd) + " is not a multiple of --n_head " +
                                                 std::to_string(f.nHead));
    }
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return fsdp::runMain("fsdp-gpu-bench", [&] { return run(f); });
}
