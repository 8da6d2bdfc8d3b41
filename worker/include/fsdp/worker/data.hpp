#pragma once
// Data for distributed training: a dataset of examples, a sampler that gives every rank its
// slice of each global batch (the same global order on every rank, reshuffled per epoch),
// and a loader that prepares the next batches on a background thread.
//
//   fsdp::TensorDataset train(images, labels);
//   fsdp::DistributedSampler sampler(train.size(), rt->rank(), rt->worldSize(),
//                                    {.globalBatch = 256, .seed = 0});
//   fsdp::DataLoader loader(train, sampler, {.epoch = 0, .step = 0});
//   while (auto b = loader.next()) { ... b->batch.input ... }
//
// Positions are (epoch, step within the epoch) in global batches: a checkpoint stores one and
// a resumed run continues from it, at any world size (the global order does not depend on it).

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace fsdp::worker {

struct Batch {
  at::Tensor input;
  at::Tensor target;
  std::int64_t tokens = 0;  // tokens in the batch, for language models (0 otherwise)
};

// Examples by index. get() runs on the loader's thread: it must be safe to call while the
// training thread runs (read-only data is).
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual std::int64_t size() const = 0;
  // The examples at `indices` (1-D, int64), stacked.
  virtual Batch get(const at::Tensor& indices) const = 0;
};

// Inputs and targets already in memory, one example per row.
class TensorDataset : public Dataset {
 public:
  // Throws ConfigError when the row counts differ.
  TensorDataset(at::Tensor inputs, at::Tensor targets);
  std::int64_t size() const override { return inputs_.size(0); }
  Batch get(const at::Tensor& indices) const override;

 private:
  at::Tensor inputs_;
  at::Tensor targets_;
};

// Every window of `blockSize` + 1 consecutive tokens of a 1-D token tensor: input the first
// blockSize, target the last blockSize (next-token prediction).
class TokenWindowDataset : public Dataset {
 public:
  TokenWindowDataset(at::Tensor tokens, std::int64_t blockSize);
  std::int64_t size() const override;
  Batch get(const at::Tensor& indices) const override;

 private:
  at::Tensor windows_;  // [n - blockSize, blockSize + 1] view of the tokens
  std::int64_t blockSize_;
};

// A fixed selection of another dataset's examples (e.g. a validation subset).
class SubsetDataset : public Dataset {
 public:
  // `indices` (1-D, int64) into `base`, which must outlive this.
  SubsetDataset(const Dataset& base, at::Tensor indices);
  std::int64_t size() const override { return indices_.size(0); }
  Batch get(const at::Tensor& indices) const override;

 private:
  const Dataset& base_;
  at::Tensor indices_;
};

struct SamplerPosition {
  int epoch = 0;           // counted from 0
  std::int64_t step = 0;   // global batches already taken in this epoch
  bool operator==(const SamplerPosition&) const = default;
};

enum class LastBatch {
  kPartial,  // the last global batch of an epoch is smaller
  kDrop,     // ... is left out
  kPad,      // ... is filled up with examples from the start of the epoch's order
};

struct SamplerOptions {
  std::int64_t globalBatch = 1;  // examples per step over all ranks
  bool shuffle = true;           // a fresh order every epoch, from seed + epoch
  std::uint64_t seed = 0;
  LastBatch lastBatch = LastBatch::kPartial;
};

// Splits each global batch over the ranks (chunkSizes: the first ones take one more).
// Thread-safe for const use.
class DistributedSampler {
 public:
  // Throws ConfigError when the global batch is smaller than the world or the dataset empty.
  DistributedSampler(std::int64_t datasetSize, int rank, int worldSize, SamplerOptions options);
  std::int64_t stepsPerEpoch() const;
  // This rank's example indices for a step, and the global batch size of that step.
  at::Tensor indices(const SamplerPosition& at) const;
  std::int64_t globalBatchAt(std::int64_t step) const;
  // The position after `at` (the next epoch's start after its last step).
  SamplerPosition next(const SamplerPosition& at) const;
  const SamplerOptions& options() const { return options_; }
  int rank() const { return rank_; }
  int worldSize() const { return world_; }

 private:
  at::Tensor order(int epoch) const;  // the epoch's permutation (cached)
  std::int64_t size_;
  int rank_;
  int world_;
  SamplerOptions options_;
  mutable std::mutex mutex_;
  mutable int cachedEpoch_ = -1;
  mutable at::Tensor cachedOrder_;
};

// Prepares batches in order from a start position, `prefetch` ahead, on its own thread. The
// destructor stops and joins the thread. Not copyable; one consumer thread.
class DataLoader {
 public:
  struct Item {
    SamplerPosition position;  // the step this batch is
    std::int64_t globalBatch = 0;
    Batch batch;               // this rank's part
  };
  DataLoader(const Dataset& data, const DistributedSampler& sampler, SamplerPosition start,
             int prefetch = 2);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;
  // The next batch (blocks until it is ready); rethrows an error of the dataset.
  Item next();

 private:
  void produce(SamplerPosition position);
  const Dataset& data_;
  const DistributedSampler& sampler_;
  const int prefetch_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Item> ready_;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace fsdp::worker

namespace fsdp {
using worker::Batch;
using worker::DataLoader;
using worker::Dataset;
using worker::DistributedSampler;
using worker::LastBatch;
using worker::SamplerOptions;
using worker::SamplerPosition;
using worker::SubsetDataset;
using worker::TensorDataset;
using worker::TokenWindowDataset;
}  // namespace fsdp
