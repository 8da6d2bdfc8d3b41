// Pickles (what torch.load reads): writing a {name: tensor} dict durably, and the full
// (unsharded) checkpoint rank 0 writes that way.
#include <torch/serialize.h>

#include "checkpoint_internal.hpp"
#include "fsdp/worker/runtime.hpp"

namespace fsdp::worker {
namespace detail {

void writePickle(const c10::Dict<std::string, at::Tensor>& dict, const std::string& path) {
  const auto bytes = torch::pickle_save(c10::IValue(dict));
  const std::string tmp = path + ".tmp";
  writeFileDurably(tmp, {bytes.data(), bytes.size()});
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) throw Error("renaming " + tmp + " to " + path + ": " + ec.message());
}

}  // namespace detail

using namespace detail;

void saveFullCheckpoint(Runtime& runtime, FullyShardedDataParallel& model, const std::string& path) {
  c10::Dict<std::string, at::Tensor> dict;
  const bool writer = runtime.rank() == 0;
  model->visitFullParameters([&](const std::string& name, const at::Tensor& full) {
    if (writer) dict.insert(name, full.to(at::kCPU, full.scalar_type(), false, /*copy=*/true));
  });
  if (writer) {
    for (const auto& [name, buffer] : model->namedBuffers()) {
      dict.insert(name, buffer.to(at::kCPU, buffer.scalar_type(), false, /*copy=*/true));
    }
    writePickle(dict, path);
  }
  runtime.cpuComm().barrier().wait();
}

}  // namespace fsdp::worker
