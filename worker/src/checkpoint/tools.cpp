// Offline tools behind fsdp-ckpt: inspecting a checkpoint (every CRC checked), consolidating it
// into one pickle, resharding it for another world size.
#include <algorithm>
#include <sstream>

#include "checkpoint_internal.hpp"

namespace fsdp::worker {

using namespace detail;

std::string inspectCheckpoint(const std::string& path) {
  const Manifest m = readManifest(path);
  Reader reader(m);
  std::uint64_t bytes = 0;
  std::int64_t elements = 0;
  for (int f = 0; f < m.files; ++f) {
    reader.file(f);  // size check
    for (const auto& b : m.blocks[static_cast<std::size_t>(f)]) {
      reader.blockTensor(f, b, {static_cast<std::int64_t>(b.bytes)}, at::kByte);  // CRC check
    }
    bytes += m.fileBytes[static_cast<std::size_t>(f)];
  }
  for (const auto& [name, p] : m.params) elements += p.numel;
  std::ostringstream out;
  out << "checkpoint " << path << ": complete, every block's CRC-32 checks\n"
      << "  step " << m.meta["step"] << ", epoch " << m.meta["epoch"] << ", step in epoch "
      << m.meta["step_in_epoch"] << ", seed " << m.meta["seed"] << "\n"
      << "  saved by " << m.meta["world_size"] << " rank(s), " << m.meta["strategy"].get<std::string>()
      << ", shard size " << m.meta["shard_size"] << ", library " << m.meta["library_version"].get<std::string>()
      << "\n"
      << "  " << m.params.size() << " parameters (" << elements << " elements) in "
      << m.flatNumel.size() << " flat parameters; optimizer "
      << (m.optimizerKind.empty() ? std::string("none") : m.optimizerKind) << "\n"
      << "  " << m.files << " rank file(s), " << bytes << " bytes\n";
  for (const auto& name : m.paramOrder) {
    const auto& p = m.params.at(name);
    out << "    " << name << " " << at::IntArrayRef(p.shape) << " "
        << m.flatDtype[static_cast<std::size_t>(p.flat)] << "\n";
  }
  return out.str();
}

void consolidateCheckpoint(const std::string& path, const std::string& outFile) {
  const Manifest m = readManifest(path);
  Reader reader(m);
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& name : m.paramOrder) {
    const auto& p = m.params.at(name);
    auto t = at::empty(p.shape, at::TensorOptions().dtype(parseDtype(m.flatDtype[static_cast<std::size_t>(p.flat)], path)));
    reader.paramRange(p, "param", 0, p.numel, static_cast<char*>(t.data_ptr()), t.element_size());
    dict.insert(name, t);
  }
  for (const auto& [name, tensor] : readBuffers(reader, m)) dict.insert(name, tensor);
  writePickle(dict, outFile);
}

void reshardCheckpoint(const std::string& path, const std::string& outDir, int world) {
  if (world < 1) throw ConfigError("--world " + std::to_string(world) + ": expected a positive number of ranks");
  const Manifest m = readManifest(path);
  Reader reader(m);
  if (fs::exists(outDir)) throw ConfigError("OUT '" + outDir + "' exists: refusing to overwrite it");
  const std::string tmp = outDir + ".tmp";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) throw Error("creating " + tmp + ": " + ec.message());
  std::vector<std::string> kinds{"param"};
  for (const auto& n : optimizerStateNames(m)) kinds.push_back("optim/" + n);
  json files = json::array();
  for (int r = 0; r < world; ++r) {
    RankPlan plan;
    plan.rank = r;
    for (std::size_t f = 0; f < m.flatNumel.size(); ++f) {
      const std::int64_t numel = m.flatNumel[f];
      const std::int64_t shard = (numel + world - 1) / world;
      const std::int64_t start = shard * r;
      const std::int64_t valid = std::max<std::int64_t>(0, std::min(shard, numel - start));
      if (valid == 0) continue;
      const auto dtype = parseDtype(m.flatDtype[f], path);
      for (const auto& what : kinds) {
        auto t = at::empty({valid}, at::TensorOptions().dtype(dtype));
        reader.flatRange(static_cast<int>(f), what, start, valid, static_cast<char*>(t.data_ptr()), t.element_size());
        addBlock(plan, {.flat = static_cast<int>(f), .what = what, .start = start, .count = valid}, t, false);
      }
    }
    if (r == 0) {
      for (const auto& b : m.blocks[0]) {
        if (!b.what.starts_with("buffer/")) continue;
        // Raw bytes: the block keeps its own dtype and shape.
        addBlock(plan, b, reader.blockTensor(0, b, {static_cast<std::int64_t>(b.bytes)}, at::kByte), false);
      }
    }
    writeRankFile(tmp + "/" + rankFileName(r), plan);
    json file = rankFileJson(plan);
    file["file"] = rankFileName(r);
    files.push_back(std::move(file));
  }
  json meta = m.meta;
  meta["world_size"] = world;
  meta["shard_size"] = world;
  meta["files"] = files;
  writeFileDurably(tmp + "/metadata.json", meta.dump(1));
  writeFileDurably(tmp + "/COMMIT", "complete\n");
  syncDirectory(tmp);
  fs::rename(tmp, outDir, ec);
  if (ec) throw Error("renaming " + tmp + " to " + outDir + ": " + ec.message());
}

}  // namespace fsdp::worker
