#include "fsdp/worker/data.hpp"
#include "fsdp/worker/flight_recorder.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>

#include "fsdp/common/error.hpp"
#include "fsdp/worker/communicator.hpp"

namespace fsdp::worker {

TensorDataset::TensorDataset(at::Tensor inputs, at::Tensor targets)
    : inputs_(std::move(inputs)), targets_(std::move(targets)) {
  if (inputs_.size(0) != targets_.size(0)) {
    throw ConfigError("TensorDataset: " + std::to_string(inputs_.size(0)) + " inputs but " +
                      std::to_string(targets_.size(0)) + " targets");
  }
}

Batch TensorDataset::get(const at::Tensor& indices) const {
  return {inputs_.index_select(0, indices), targets_.index_select(0, indices), 0};
}

TokenWindowDataset::TokenWindowDataset(at::Tensor tokens, std::int64_t blockSize)
    : blockSize_(blockSize) {
  if (tokens.dim() != 1 || tokens.size(0) <= blockSize + 1) {
    throw ConfigError("TokenWindowDataset: " + std::to_string(tokens.numel()) +
                      " tokens are too few for windows of " + std::to_string(blockSize + 1));
  }
  windows_ = tokens.unfold(0, blockSize + 1, 1);
}

std::int64_t TokenWindowDataset::size() const { return windows_.size(0); }

Batch TokenWindowDataset::get(const at::Tensor& indices) const {
  const auto rows = windows_.index_select(0, indices);
  return {rows.narrow(1, 0, blockSize_).contiguous(), rows.narrow(1, 1, blockSize_).contiguous(),
          indices.numel() * blockSize_};
}

SubsetDataset::SubsetDataset(const Dataset& base, at::Tensor indices)
    : base_(base), indices_(std::move(indices)) {
  if (indices_.numel() > 0 && (indices_.min().item<std::int64_t>() < 0 ||
                               indices_.max().item<std::int64_t>() >= base_.size())) {
    throw ConfigError("SubsetDataset: indices outside the dataset's " + std::to_string(base_.size()) + " examples");
  }
}

Batch SubsetDataset::get(const at::Tensor& indices) const { return base_.get(indices_.index_select(0, indices)); }

DistributedSampler::DistributedSampler(std::int64_t datasetSize, int rank, int worldSize,
                                       SamplerOptions options)
    : size_(datasetSize), rank_(rank), world_(worldSize), options_(options) {
  if (size_ < 1) throw ConfigError("DistributedSampler: the dataset is empty");
  if (options_.globalBatch < world_) {
    throw ConfigError("batch size " + std::to_string(options_.globalBatch) +
                      ": must be at least the world size " + std::to_string(world_));
  }
  if (options_.lastBatch == LastBatch::kDrop && size_ < options_.globalBatch) {
    throw ConfigError("batch size " + std::to_string(options_.globalBatch) + " with drop_last: the dataset has only " +
                      std::to_string(size_) + " examples");
  }
}

std::int64_t DistributedSampler::stepsPerEpoch() const {
  const auto b = options_.globalBatch;
  return options_.lastBatch == LastBatch::kDrop ? size_ / b : (size_ + b - 1) / b;
}

std::int64_t DistributedSampler::globalBatchAt(std::int64_t step) const {
  if (options_.lastBatch != LastBatch::kPartial) return options_.globalBatch;
  return std::min(options_.globalBatch, size_ - step * options_.globalBatch);
}

at::Tensor DistributedSampler::order(int epoch) const {
  std::scoped_lock lock(mutex_);
  if (epoch != cachedEpoch_) {
    if (options_.shuffle) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(options_.seed + static_cast<std::uint64_t>(epoch) + 1);
      cachedOrder_ = at::randperm(size_, gen, at::kLong);
    } else {
      cachedOrder_ = at::arange(size_, at::kLong);
    }
    cachedEpoch_ = epoch;
  }
  return cachedOrder_;
}

at::Tensor DistributedSampler::indices(const SamplerPosition& at) const {
  const auto perm = order(at.epoch);
  const std::int64_t begin = at.step * options_.globalBatch;
  const std::int64_t global = globalBatchAt(at.step);
  const auto counts = chunkSizes(global, world_);
  std::int64_t mine = begin;
  for (int r = 0; r < rank_; ++r) mine += counts[static_cast<std::size_t>(r)];
  const std::int64_t count = counts[static_cast<std::size_t>(rank_)];
  if (mine + count <= size_) return perm.narrow(0, mine, count);
  // Padding: wrap around to the start of the epoch's order.
  return perm.index_select(0, at::arange(mine, mine + count, at::kLong).remainder_(size_));
}

SamplerPosition DistributedSampler::next(const SamplerPosition& at) const {
  if (at.step + 1 < stepsPerEpoch()) return {at.epoch, at.step + 1};
  return {at.epoch + 1, 0};
}

DataLoader::DataLoader(const Dataset& data, const DistributedSampler& sampler, SamplerPosition start,
                       int prefetch)
    : data_(data), sampler_(sampler), prefetch_(std::max(1, prefetch)) {
  thread_ = std::thread([this, start] { produce(start); });
}

DataLoader::~DataLoader() {
  {
    std::scoped_lock lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void DataLoader::produce(SamplerPosition position) {
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [this] { return stop_ || static_cast<int>(ready_.size()) < prefetch_; });
      if (stop_) return;
    }
    Item item;
    try {
      item.position = position;
      item.globalBatch = sampler_.globalBatchAt(position.step);
      item.batch = data_.get(sampler_.indices(position));
    } catch (...) {
      std::scoped_lock lock(mutex_);
      error_ = std::current_exception();
      changed_.notify_all();
      return;
    }
    {
      std::scoped_lock lock(mutex_);
      ready_.push_back(std::move(item));
    }
    changed_.notify_all();
    position = sampler_.next(position);
  }
}

DataLoader::Item DataLoader::next() {
  const DataWait waiting;  // the step split counts this as data time
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [this] { return !ready_.empty() || error_; });
  if (ready_.empty()) std::rethrow_exception(error_);
  Item item = std::move(ready_.front());
  ready_.pop_front();
  lock.unlock();
  changed_.notify_all();
  return item;
}

}  // namespace fsdp::worker
