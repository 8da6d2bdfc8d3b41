// Sharded checkpoints with 1-4 ranks as threads of this process (real Gloo, a real store on
// loopback, real files): round trips, resharding, the offline tools, and refusals.
#include "fsdp/worker/checkpoint.hpp"

#include <ATen/Functions.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/serialize.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "fsdp/common/error.hpp"
#include "fsdp/worker/runtime.hpp"
#include "run_command.hpp"
#include "torch_ranks.hpp"

namespace fsdp::worker {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;
using Params = std::vector<std::pair<std::string, at::Tensor>>;

// Ranks as threads, each with a Runtime of its own.
void runRanks(int world, const std::function<void(Runtime&)>& body) { fsdp::testing::runRuntimes(world, body); }

// Sizes that do not divide by 2, 3 or 4 (padding everywhere); three units.
torch::nn::Sequential makeModel(std::int64_t hidden = 29) {
  torch::nn::Sequential m;
  m->push_back("fc1", torch::nn::Linear(13, hidden));
  m->push_back("act", torch::nn::Tanh());
  m->push_back("fc2", torch::nn::Linear(hidden, 5));
  at::NoGradGuard noGrad;
  double k = 0.3;
  for (auto& p : m->parameters()) {
    p.copy_(at::cos(at::arange(p.numel(), at::kFloat).mul(0.21).add(k)).reshape(p.sizes()).mul(0.2));
    k += 0.5;
  }
  return m;
}

const FsdpOptions kOptions{.autoWrap = AutoWrapPolicy::minParams(50)};

void trainSteps(FullyShardedDataParallel& model, torch::optim::Optimizer& opt, Runtime& rt, int from, int to) {
  auto gen = at::detail::createCPUGenerator(99);
  const auto x = at::randn({40, 12, 13}, gen);
  const auto y = at::randn({40, 12, 5}, gen);
  const auto counts = chunkSizes(12, rt.worldSize());
  std::int64_t first = 0;
  for (int r = 0; r < rt.rank(); ++r) first += counts[static_cast<std::size_t>(r)];
  for (int s = from; s < to; ++s) {
    opt.zero_grad();
    const auto mine = counts[static_cast<std::size_t>(rt.rank())];
    auto loss = torch::nn::functional::mse_loss(model->forward(x[s].narrow(0, first, mine)),
                                                y[s].narrow(0, first, mine),
                                                torch::nn::functional::MSELossFuncOptions().reduction(torch::kSum)) *
                (static_cast<double>(rt.worldSize()) / 12.0 / 5.0);
    loss.backward();
    opt.step();
  }
}

void expectClose(const Params& a, const Params& b, double rtol, double atol) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(at::allclose(a[i].second, b[i].second, rtol, atol))
        << a[i].first << ": max difference " << (a[i].second - b[i].second).abs().max().item<double>();
  }
}

// Trains `world` ranks to step `to`, saving at `saveAt`; returns the final full parameters.
Params trainAndSave(int world, const std::string& dir, int saveAt, int to, CheckpointOptions extra = {}) {
  Params out;
  std::mutex mutex;
  runRanks(world, [&](Runtime& rt) {
    FullyShardedDataParallel model(makeModel(), rt.comm(), kOptions);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
    CheckpointOptions o = extra;
    o.dir = dir;
    Checkpointer ckpt(rt, o);
    trainSteps(model, opt, rt, 0, saveAt);
    ckpt.save(model, &opt, {.step = saveAt, .position = {0, saveAt}, .seed = 5});
    trainSteps(model, opt, rt, saveAt, to);
    ckpt.wait();
    auto full = model->fullParameters();
    if (rt.rank() == 0) {
      std::scoped_lock lock(mutex);
      out = full;
    }
  });
  return out;
}

// Resumes on `world` ranks from the newest checkpoint and trains to step `to`.
Params resumeAndTrain(int world, const std::string& dir, int to, std::optional<TrainingProgress>* seen = nullptr) {
  Params out;
  std::mutex mutex;
  runRanks(world, [&](Runtime& rt) {
    FullyShardedDataParallel model(makeModel(), rt.comm(), kOptions);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
    Checkpointer ckpt(rt, {.dir = dir});
    const auto progress = ckpt.loadLatest(model, &opt);
    if (!progress) throw Error("no checkpoint in " + dir);
    trainSteps(model, opt, rt, static_cast<int>(progress->step), to);
    auto full = model->fullParameters();
    if (rt.rank() == 0) {
      std::scoped_lock lock(mutex);
      out = full;
      if (seen != nullptr) *seen = progress;
    }
  });
  return out;
}

TEST(Checkpoint, ResumingAtTheSameWorldSizeContinuesBitForBit) {
  testing::TempDir dir;
  const auto straight = trainAndSave(2, dir.path(), 6, 12);
  std::optional<TrainingProgress> progress;
  const auto resumed = resumeAndTrain(2, dir.path(), 12, &progress);
  ASSERT_TRUE(progress);
  EXPECT_EQ(progress->step, 6);
  EXPECT_EQ(progress->position, (SamplerPosition{0, 6}));
  EXPECT_EQ(progress->seed, 5u);
  expectClose(straight, resumed, 0, 0);  // parameters and Adam's moments came back exactly
}

TEST(Checkpoint, LoadsAtAnyWorldSizeAndTheTrainingContinues) {
  testing::TempDir dir;
  const auto straight = trainAndSave(2, dir.path(), 6, 12);
  for (const int world : {1, 3, 4}) {
    expectClose(straight, resumeAndTrain(world, dir.path(), 12), 1e-5, 1e-6);
  }
}

TEST(Checkpoint, AnAsynchronousSaveIsCommittedAndLoadable) {
  testing::TempDir dir;
  const auto straight = trainAndSave(2, dir.path(), 6, 12, {.async = true});
  EXPECT_TRUE(newestCheckpoint(dir.path()).has_value());
  expectClose(straight, resumeAndTrain(2, dir.path(), 12), 0, 0);
}

TEST(Checkpoint, KeepsTheNewestKAndIgnoresUnfinishedDirectories) {
  testing::TempDir dir;
  runRanks(2, [&](Runtime& rt) {
    FullyShardedDataParallel model(makeModel(), rt.comm(), kOptions);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
    Checkpointer ckpt(rt, {.dir = dir.path(), .keep = 2});
    for (int step = 1; step <= 4; ++step) {
      trainSteps(model, opt, rt, step - 1, step);
      ckpt.save(model, &opt, {.step = step});
    }
  });
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step_00000003", "step_00000004"}));
  // A directory without its COMMIT marker (a save that died) does not count.
  fs::create_directories(dir.path() + "/step_00000009");
  EXPECT_EQ(fs::path(*newestCheckpoint(dir.path())).filename(), "step_00000004");
}

TEST(Checkpoint, TheOfflineToolsConsolidateAndReshard) {
  testing::TempDir dir;
  const auto straight = trainAndSave(2, dir.path(), 6, 6);  // saved at the end
  const auto path = *newestCheckpoint(dir.path());
  EXPECT_NE(inspectCheckpoint(path).find("fc1.weight [29, 13] Float"), std::string::npos);
  // Consolidated: what Python's torch.load reads.
  consolidateCheckpoint(path, dir.path() + "/full.pt");
  std::ifstream in(dir.path() + "/full.pt", std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto dict = torch::pickle_load(bytes).toGenericDict();
  for (const auto& [name, value] : straight) {
    EXPECT_TRUE(at::equal(dict.at(name).toTensor(), value)) << name;
  }
  // Resharded for 3 ranks: the same weights come back on 3 ranks.
  reshardCheckpoint(path, dir.path() + "/three/step_00000006", 3);
  EXPECT_NE(inspectCheckpoint(dir.path() + "/three/step_00000006").find("saved by 3 rank(s)"), std::string::npos);
  EXPECT_THROW(reshardCheckpoint(path, dir.path() + "/three/step_00000006", 3), ConfigError);  // never overwrites
  expectClose(straight, resumeAndTrain(3, dir.path() + "/three", 6), 0, 0);
}

// What a refused load must leave: an error naming the problem, the model untouched.
void expectRefused(const std::string& dir, const std::string& mention, std::int64_t hidden = 29,
                   const std::function<void(torch::nn::Sequential&)>& change = {}) {
  std::mutex mutex;
  std::vector<std::string> errors;
  runRanks(2, [&](Runtime& rt) {
    auto net = makeModel(hidden);
    if (change) change(net);
    FullyShardedDataParallel model(net, rt.comm(), kOptions);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
    const auto before = model->fullParameters();
    Checkpointer ckpt(rt, {.dir = dir});
    try {
      ckpt.loadLatest(model, &opt);
      std::scoped_lock lock(mutex);
      errors.push_back("");
    } catch (const ConfigError& e) {
      std::scoped_lock lock(mutex);
      errors.push_back(e.what());
    }
    const auto after = model->fullParameters();
    for (std::size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(before[i].second, after[i].second));
  });
  for (const auto& e : errors) EXPECT_NE(e.find(mention), std::string::npos) << "error: '" << e << "', expected: " << mention;
}

TEST(Checkpoint, BuffersKeepTheModelsOwnNamesWhateverTheWrapPolicy) {
  testing::TempDir dir;
  // fc2's buffer lies in an auto-wrapped unit (the unit adds a level to the module's paths);
  // fc1 shares the root's (a state_dict has both names).
  const auto withBuffers = [](std::int64_t fill) {
    auto net = makeModel();
    const auto mask = net->register_buffer("mask", at::full({5}, fill));
    net[0]->register_buffer("shared", mask);
    net[2]->register_buffer("scale", at::full({5}, fill));
    return net;
  };
  runRanks(2, [&](Runtime& rt) {
    FullyShardedDataParallel model(withBuffers(3), rt.comm(), kOptions);
    std::vector<std::string> names;
    for (const auto& [name, buffer] : model->namedBuffers()) names.push_back(name);
    EXPECT_EQ(names, (std::vector<std::string>{"mask", "fc1.shared", "fc2.scale"}));
    Checkpointer ckpt(rt, {.dir = dir.path()});
    ckpt.save(model, nullptr, {.step = 1});
    ckpt.wait();
  });
  const std::string path = *newestCheckpoint(dir.path());
  consolidateCheckpoint(path, dir.path() + "/full.pt");  // what PyTorch's load_state_dict reads
  std::ifstream in(dir.path() + "/full.pt", std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto dict = torch::pickle_load(bytes).toGenericDict();
  EXPECT_TRUE(dict.contains("fc2.scale"));
  EXPECT_TRUE(dict.contains("fc1.shared"));
  EXPECT_FALSE(dict.contains("fc2.module.scale"));
  // Loaded with another policy (no auto-wrap), then with the same: the saved values every time.
  const auto loaded = [&](const FsdpOptions& options) {
    std::map<std::string, double> values;
    std::mutex mutex;
    runRanks(2, [&](Runtime& rt) {
      FullyShardedDataParallel model(withBuffers(0), rt.comm(), options);
      Checkpointer(rt, {.dir = dir.path()}).loadLatest(model, nullptr);
      std::scoped_lock lock(mutex);
      for (const auto& [name, buffer] : model->namedBuffers()) values[name] = buffer.max().item<double>();
    });
    return values;
  };
  const std::map<std::string, double> saved{{"mask", 3}, {"fc1.shared", 3}, {"fc2.scale", 3}};
  EXPECT_EQ(loaded(FsdpOptions{}), saved);
  EXPECT_EQ(loaded(kOptions), saved);
  // A checkpoint saved before buffers kept their names (the wrapped module's paths, no marker)
  // loads as it did: by this model's paths, a buffer it does not have left as it is.
  auto meta = nlohmann::json::parse(fsdp::testing::readFile(path + "/metadata.json"));
  ASSERT_EQ(meta.erase("buffer_names"), 1u);
  for (auto& file : meta.at("files")) {
    for (auto& block : file.at("blocks")) {
      if (block.at("what") == "buffer/fc2.scale") block["what"] = "buffer/fc2.module.scale";
    }
  }
  std::ofstream(path + "/metadata.json") << meta.dump();
  EXPECT_EQ(loaded(kOptions), saved);
  EXPECT_EQ(loaded(FsdpOptions{}), (std::map<std::string, double>{{"mask", 3}, {"fc1.shared", 3}, {"fc2.scale", 0}}));
  // A buffer the model lacks is refused, as PyTorch's strict load_state_dict refuses it.
  runRanks(2, [&](Runtime& rt) {
    auto net = makeModel();
    net->register_buffer("mask", at::full({5}, 0));
    FullyShardedDataParallel model(net, rt.comm(), kOptions);
    Checkpointer ckpt(rt, {.dir = dir.path() + "/strict"});
    ckpt.save(model, nullptr, {.step = 1});
    ckpt.wait();
  });
  expectRefused(dir.path() + "/strict", "the model has no buffer 'mask' (wrong model?)");
}

TEST(Checkpoint, CorruptOrMismatchedCheckpointsAreRefusedNamingTheFile) {
  testing::TempDir dir;
  trainAndSave(2, dir.path(), 3, 3);
  const std::string ckpt = *newestCheckpoint(dir.path());
  const std::string rank1 = ckpt + "/rank_00001.bin";
  const auto size = fs::file_size(rank1);
  // A model with other shapes.
  expectRefused(dir.path(), "parameter 'fc1.weight' has shape [29, 13] there but [31, 13] here", 31);
  // A buffer the checkpoint lacks (as PyTorch's load_state_dict, strict), or of another shape.
  expectRefused(dir.path(), "it has no buffer 'mask' (wrong model?)", 29,
                [](torch::nn::Sequential& net) { net->register_buffer("mask", at::ones({5})); });
  expectRefused(dir.path(), "it has no buffer 'fc2.mask' (wrong model?)", 29,
                [](torch::nn::Sequential& net) { net[2]->register_buffer("mask", at::ones({5})); });
  {
    testing::TempDir masked;
    runRanks(2, [&](Runtime& rt) {
      auto net = makeModel();
      net->register_buffer("mask", at::ones({5}));
      FullyShardedDataParallel model(net, rt.comm(), kOptions);
      Checkpointer ckpt(rt, {.dir = masked.path()});
      ckpt.save(model, nullptr, {.step = 1});
      ckpt.wait();
    });
    expectRefused(masked.path(), "buffer 'mask' has shape [5] there but [6] here", 29,
                  [](torch::nn::Sequential& net) { net->register_buffer("mask", at::ones({6})); });
  }
  // A flipped byte: the block's CRC.
  {
    std::fstream f(rank1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.put('\x5a');
  }
  expectRefused(dir.path(), "rank_00001.bin: block 'param'");
  // A truncated shard.
  fs::resize_file(rank1, size / 2);
  expectRefused(dir.path(), rank1 + " has " + std::to_string(size / 2) + " bytes");
  // Missing metadata.
  fs::remove(ckpt + "/metadata.json");
  expectRefused(dir.path(), ckpt + "/metadata.json is missing");
  // Nothing was overwritten or removed by the refusals.
  EXPECT_TRUE(fs::exists(rank1));
  EXPECT_EQ(fs::file_size(rank1), size / 2);
}

}  // namespace
}  // namespace fsdp::worker
