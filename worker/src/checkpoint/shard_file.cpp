// Rank (shard) files: laying out a rank's blocks, writing them with their CRCs, their block
// list for the metadata, and reading the saved module buffers back (Reader is in the header).
#include "checkpoint_internal.hpp"

namespace fsdp::worker::detail {

// The module buffers saved, by name.
std::map<std::string, at::Tensor> readBuffers(Reader& reader, const Manifest& m) {
  std::map<std::string, at::Tensor> buffers;
  // Rank 0 saves them to disk; in a snapshot every rank holds them: the first file that has any.
  for (int f = 0; f < m.files; ++f) {
    for (const auto& b : m.blocks[static_cast<std::size_t>(f)]) {
      if (!b.what.starts_with("buffer/")) continue;
      buffers[b.what.substr(7)] = reader.blockTensor(f, b, b.shape, parseDtype(b.dtype, m.path));
    }
    if (!buffers.empty()) break;
  }
  return buffers;
}

at::Tensor Reader::view(int index, const Block& b, const at::Tensor& like) const {
  const auto it = maps_.find(index);
  const std::uint64_t bytes = static_cast<std::uint64_t>(like.numel()) * like.element_size();
  if (it == maps_.end() || m_.checkCrc || !like.device().is_cpu() || b.dtype != dtypeName(like.scalar_type()) ||
      b.bytes > bytes || b.offset % like.element_size() != 0 || b.offset + bytes > it->second.bytes) {
    return {};
  }
  // The padding after the block: in no other block (a snapshot laid out by step() gives each
  // shard its whole size; one written by copying packs the blocks).
  for (const auto& other : m_.blocks[static_cast<std::size_t>(index)]) {
    if ((other.flat == b.flat && other.what == b.what && other.offset == b.offset) || other.bytes == 0) continue;
    if (other.offset < b.offset + bytes && b.offset < other.offset + other.bytes) return {};
  }
  std::shared_ptr<char> keep = it->second.base;  // the mapping stays while the view lives
  return at::from_blob(keep.get() + b.offset, like.sizes(), [keep](void*) mutable { keep.reset(); },
                       like.options().requires_grad(false));
}

void addBlock(RankPlan& plan, Block b, at::Tensor data, bool copy) {
  // One copy at most: a device tensor's copy to the host is already the snapshot.
  data = data.to(at::kCPU, data.scalar_type(), /*non_blocking=*/false, /*copy=*/copy).contiguous();
  b.bytes = static_cast<std::uint64_t>(data.numel()) * data.element_size();
  if (b.dtype.empty()) b.dtype = dtypeName(data.scalar_type());
  plan.blocks.push_back(std::move(b));
  plan.data.push_back(std::move(data));
}

// Writes a rank's file (fsync'ed); fills offsets and CRCs of its blocks.
void writeRankFile(const std::string& path, RankPlan& plan) {
  File out(path, O_WRONLY | O_CREAT | O_TRUNC);
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
    auto& b = plan.blocks[i];
    const auto* bytes = plan.data[i].data_ptr();
    b.offset = offset;
    b.crc = crc32Of(bytes, b.bytes);
    out.writeAll(bytes, b.bytes);
    offset += b.bytes;
  }
  out.sync();
}

json rankFileJson(const RankPlan& plan) {
  std::uint64_t bytes = 0;
  json blocks = json::array();
  for (const auto& b : plan.blocks) {
    blocks.push_back(blockJson(b));
    bytes += b.bytes;
  }
  return json{{"rank", plan.rank}, {"bytes", bytes}, {"blocks", blocks}};
}

}  // namespace fsdp::worker::detail
