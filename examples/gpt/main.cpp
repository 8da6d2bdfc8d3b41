// gpt: a minGPT-style character-level language model trained under FSDP on real English text
// (Debian's fortunes), each transformer block an FSDP unit; prints sampled text at the end.
//
//   fsdprun --standalone --nproc_per_node 2 build/bin/gpt --max_steps 300
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <torch/optim/adamw.h>

#include "../common/example_utils.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/worker/errors.hpp"
#include "fsdp/worker/fsdp.hpp"
#include "fsdp/worker/runtime.hpp"
#include "fsdp/worker/trainer.hpp"
#include "model.hpp"

namespace {


struct Flags {
  std::string data = "/usr/share/games/fortunes";
  std::int64_t nLayer = 4, nHead = 4, nEmbd = 128, blockSize = 128;
  int batchSize = 32;  // global, in sequences
  long long maxSteps = 300;
  double lr = 1e-3;
  long long seed = 0;
  int evalEvery = 100;
  int evalBatches = 8;
  int logEvery = 50;
  int sampleChars = 300;
  std::string sharding = "FULL_SHARD";
  std::string mixedPrecision = "no";
  bool checkpointing = false;
  std::string metricsFile;
  std::string checkpointDir;
  int checkpointEvery = 0;
  int snapshotEvery = 1;
  int gradAccumulation = 1;
};

// Every regular text file under `path` (or `path` itself), fortune index files (.dat) left out.
std::string readCorpus(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    files.emplace_back(path);
  } else if (fs::is_directory(path, ec)) {
    for (const auto& entry : fs::recursive_directory_iterator(path, ec)) {
      if (entry.is_regular_file() && entry.path().extension() != ".dat" &&
          entry.path().extension() != ".u8") {
        files.push_back(entry.path());
      }
    }
    std::sort(files.begin(), files.end());
  }
  std::string text;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  if (text.size() < 10000) {
    throw fsdp::ConfigError("--data '" + path + "': expected text files with at least 10000 bytes (" +
                            std::to_string(text.size()) + " found; apt-get install fortunes)");
  }
  return text;
}

struct Corpus {
  std::vector<unsigned char> alphabet;  // token id -> byte
  at::Tensor train, val;                // token ids (kLong)
  double unigramLoss = 0;               // val cross-entropy under train character frequencies
};

Corpus tokenize(const std::string& text) {
  Corpus c;
  std::set<unsigned char> seen(text.begin(), text.end());
  c.alphabet.assign(seen.begin(), seen.end());
  std::array<std::int64_t, 256> id{};
  for (std::size_t i = 0; i < c.alphabet.size(); ++i) id[c.alphabet[i]] = static_cast<std::int64_t>(i);
  auto all = at::empty({static_cast<std::int64_t>(text.size())}, at::kLong);
  auto* p = all.data_ptr<std::int64_t>();
  for (std::size_t i = 0; i < text.size(); ++i) p[i] = id[static_cast<unsigned char>(text[i])];
  const auto split = all.size(0) * 9 / 10;
  c.train = all.narrow(0, 0, split);
  c.val = all.narrow(0, split, all.size(0) - split);
  const auto vocab = static_cast<std::int64_t>(c.alphabet.size());
  const auto freq = at::bincount(c.train, {}, vocab).to(at::kDouble).add_(1).div_(c.train.size(0) + vocab);
  c.unigramLoss = -freq.log().index_select(0, c.val).mean().item<double>();
  return c;
}

// Every rank runs the model (its forward is collective); rank 0 draws and broadcasts.
std::string sample(fsdp::FullyShardedDataParallel& model, const Corpus& c, const Flags& f,
                   fsdp::Runtime& rt) {
  at::NoGradGuard noGrad;
  model->eval();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(f.seed) + 7);
  std::vector<std::int64_t> context = {0};
  for (std::size_t i = 0; i < c.alphabet.size(); ++i) {
    if (c.alphabet[i] == '\n') context = {static_cast<std::int64_t>(i)};
  }
  std::string out;
  for (int i = 0; i < f.sampleChars; ++i) {
    const auto start = context.size() > static_cast<std::size_t>(f.blockSize) ? context.size() - f.blockSize : 0;
    const auto x = at::tensor(std::vector<std::int64_t>(context.begin() + static_cast<std::ptrdiff_t>(start), context.end()),
                              at::kLong).unsqueeze(0).to(rt.device());
    const auto logits = model->forward(x).to(at::kCPU, at::kFloat)[0][-1];
    auto next = at::multinomial(at::softmax(logits / 0.8, -1), 1, false, gen).to(at::kLong);
    rt.cpuComm().broadcast(next, 0).wait();
    const auto token = next.item<std::int64_t>();
    context.push_back(token);
    out.push_back(static_cast<char>(c.alphabet[static_cast<std::size_t>(token)]));
  }
  model->train();
  return out;
}

int run(const Flags& f) {
  const Corpus corpus = tokenize(readCorpus(f.data));
  if (f.nEmbd % f.nHead != 0) {
    throw fsdp::ConfigError("--n_embd " + std::to_string(f.nEmbd) + " is not a multiple of --n_head " +
                            std::to_string(f.nHead));
  }
  // The model before init(): nothing in it depends on the rank, and under fsdprun --standby a
  // spare worker has built it by the time it is needed.
  torch::manual_seed(static_cast<std::uint64_t>(f.seed));
  const fsdp::examples::GptConfig config{.vocabSize = static_cast<std::int64_t>(corpus.alphabet.size()),
                                         .blockSize = f.blockSize,
                                         .nLayer = f.nLayer,
                                         .nHead = f.nHead,
                                         .nEmbd = f.nEmbd};
  auto net = fsdp::examples::makeGpt(config);  // initialised on the CPU: the same on every device
  auto rt = fsdp::init();
  fsdp::FsdpOptions options{.strategy = fsdp::worker::parseShardingStrategy(f.sharding),
                            .autoWrap = fsdp::AutoWrapPolicy::byTypeName({"Block"}),
                            .mixedPrecision = fsdp::MixedPrecision::parse(f.mixedPrecision),
                            .syncModuleStates = true,
                            .activationCheckpointing = f.checkpointing};
  const auto groups = fsdp::examples::hybridGroupsFor(*rt, options);
  net->to(rt->device());
  fsdp::FullyShardedDataParallel model(net, rt->comm(), options);
  std::int64_t numParams = 0;
  for (const auto& u : model->units()) numParams += u.numel;
  torch::optim::AdamW optimizer(model->parameters(),
                                torch::optim::AdamWOptions(f.lr).weight_decay(0.01));
  if (rt->rank() == 0) {
    std::printf("gpt: %lld parameters, %zu characters, %lld train tokens, unigram val loss %.4f\n",
                static_cast<long long>(numParams), corpus.alphabet.size(),
                static_cast<long long>(corpus.train.size(0)), corpus.unigramLoss);
    std::fflush(stdout);
  }
  // Every window of the training text, shuffled per epoch; a fixed sample of validation windows.
  const fsdp::TokenWindowDataset train(corpus.train, f.blockSize);
  const fsdp::TokenWindowDataset valWindows(corpus.val, f.blockSize);
  auto pick = at::make_generator<at::CPUGeneratorImpl>(12345);
  const fsdp::SubsetDataset val(
      valWindows, at::randperm(valWindows.size(), pick, at::kLong)
                      .narrow(0, 0, std::min<std::int64_t>(valWindows.size(), static_cast<std::int64_t>(f.evalBatches) * f.batchSize)));
  fsdp::Trainer trainer(*rt, model, optimizer, fsdp::Trainer::crossEntropy(),
                        {.epochs = 1000000,
                         .maxSteps = f.maxSteps,
                         .globalBatch = f.batchSize,
                         .gradAccumulation = f.gradAccumulation,
                         .clipGradNorm = 1.0,
                         .seed = static_cast<std::uint64_t>(f.seed),
                         .evalBatch = f.batchSize,
                         .evaluateEveryEpoch = false,
                         .evalEvery = f.evalEvery,
                         .accuracy = true,
                         .logEvery = f.logEvery,
                         .metricsFile = f.metricsFile,
                         .progress = f.logEvery > 0 ? fsdp::ProgressStyle::kAuto : fsdp::ProgressStyle::kNone,
                         .checkpointDir = f.checkpointDir,
                         .checkpointEvery = f.checkpointEvery,
                         .snapshotEvery = f.snapshotEvery});
  const auto result = trainer.fit(train, &val);
  // Rank and world as they are now: a failure elsewhere may have re-formed this process into a
  // smaller world, where it can be rank 0.
  const bool first = rt->rank() == 0;
  if (first) {
    std::printf("step %lld: val_loss %.4f (unigram baseline %.4f) val_accuracy %.4f\n",
                static_cast<long long>(result.steps), result.eval.loss, corpus.unigramLoss, result.eval.accuracy);
    std::fflush(stdout);
  }
  const std::string text = f.sampleChars > 0 ? sample(model, corpus, f, *rt) : "";
  const std::string hash = fsdp::examples::paramsSha256(model);
  if (first) {
    if (!text.empty()) std::printf("--- sample ---\n%s\n--- end of sample ---\n", text.c_str());
    std::cout << nlohmann::json{{"model", "gpt"},
                                {"parameters", numParams},
                                {"sharding", f.sharding},
                                {"mixed_precision", f.mixedPrecision},
                                {"activation_checkpointing", f.checkpointing},
                                {"world_size", rt->worldSize()},
                                {"device", rt->device().str()},
                                {"backend", rt->comm().backendName()},
                                {"steps", result.steps},
                                {"test_loss", result.eval.loss},
                                {"test_accuracy", result.eval.accuracy},
                                {"unigram_loss", corpus.unigramLoss},
                                {"train_tokens_per_s", result.tokensPerSecond},
                                {"train_samples_per_s", result.samplesPerSecond},
                                {"peak_rss_mb", fsdp::examples::peakRssMb()},
                                {"params_sha256", hash}}
                     .dump()
              << std::endl;
  }
  rt->comm().barrier().wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"Character-level GPT under fsdprun (FSDP, one unit per transformer block)", "gpt"};
  app.add_option("--data", f.data, "A text file or a directory of them (default: Debian's fortunes)");
  app.add_option("--n_layer,--n-layer", f.nLayer, "Transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--n_head,--n-head", f.nHead, "Attention heads")->check(CLI::PositiveNumber);
  app.add_option("--n_embd,--n-embd", f.nEmbd, "Embedding width")->check(CLI::PositiveNumber);
  app.add_option("--block_size,--block-size", f.blockSize, "Context length")->check(CLI::PositiveNumber);
  app.add_option("--batch_size,--batch-size", f.batchSize, "Global batch (sequences)")->check(CLI::PositiveNumber);
  app.add_option("--max_steps,--max-steps", f.maxSteps, "Training steps")->check(CLI::PositiveNumber);
  app.add_option("--lr", f.lr, "AdamW learning rate")->check(CLI::PositiveNumber);
  app.add_option("--seed", f.seed, "Seed of initialisation, batches and sampling");
  app.add_option("--eval_every,--eval-every", f.evalEvery, "Evaluate every N steps (0 = at the end)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--eval_batches,--eval-batches", f.evalBatches, "Validation batches per evaluation")
      ->check(CLI::PositiveNumber);
  app.add_option("--log_every,--log-every", f.logEvery, "Print a line every N steps (0 = never)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--sample_chars,--sample-chars", f.sampleChars, "Characters sampled at the end")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--sharding", f.sharding, "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD")
      ->check(CLI::IsMember({"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}));
  app.add_option("--mixed_precision,--mixed-precision", f.mixedPrecision, "no, bf16 or fp16")
      ->check(CLI::IsMember({"no", "bf16", "fp16"}));
  app.add_flag("--activation_checkpointing,--activation-checkpointing", f.checkpointing,
               "Recompute each block's forward during backward");
  app.add_option("--metrics_file,--metrics-file", f.metricsFile, "JSONL metrics written by rank 0");
  fsdp::examples::addCheckpointFlags(app, f.checkpointDir, f.checkpointEvery);
  fsdp::examples::addSnapshotFlag(app, f.snapshotEvery);
  app.add_option("--grad_accumulation,--grad-accumulation", f.gradAccumulation, "Micro-batches per step")
      ->check(CLI::PositiveNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help exits 0; every usage error exits 2, as with every tool of ours.
    return app.exit(e) == 0 ? 0 : 2;
  }
  return fsdp::runMain("gpt", [&] { return run(f); });
}
