// The on-disk format: step directory and rank file names, dtype names, the metadata's block
// entries and reading a checkpoint's manifest (metadata.json) with its consistency checks.
#include <algorithm>
#include <cstdio>

#include "checkpoint_internal.hpp"

namespace fsdp::worker::detail {

std::string stepDirName(std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step_%08lld", static_cast<long long>(step));
  return name;
}

// "step_" and eight digits: the names stepDirName makes (and nothing a user left beside them).
bool isStepDirName(const std::string& name) {
  return name.size() == 13 && name.starts_with("step_") &&
         std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::string rankFileName(int rank) {
  char name[32];
  std::snprintf(name, sizeof(name), "rank_%05d.bin", rank);
  return name;
}

// ---- dtypes ------------------------------------------------------------------------------

std::string dtypeName(at::ScalarType t) { return c10::toString(t); }

at::ScalarType parseDtype(const std::string& name, const std::string& where) {
  for (const auto t : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt,
                       at::kShort, at::kChar, at::kByte, at::kBool}) {
    if (dtypeName(t) == name) return t;
  }
  throw ConfigError(where + ": unknown dtype '" + name + "'");
}

// ---- the metadata ------------------------------------------------------------------------

json blockJson(const Block& b) {
  json j{{"what", b.what}, {"offset", b.offset}, {"bytes", b.bytes}, {"crc32", b.crc}};
  if (b.flat >= 0) {
    j["flat"] = b.flat;
    j["start"] = b.start;
    j["count"] = b.count;
  }
  if (!b.dtype.empty()) j["dtype"] = b.dtype;
  if (!b.shape.empty()) j["shape"] = b.shape;
  return j;
}

Block blockFrom(const json& j) {
  Block b;
  b.what = j.at("what").get<std::string>();
  b.offset = j.at("offset").get<std::uint64_t>();
  b.bytes = j.at("bytes").get<std::uint64_t>();
  b.crc = j.at("crc32").get<std::uint32_t>();
  b.flat = j.value("flat", -1);
  b.start = j.value("start", std::int64_t{0});
  b.count = j.value("count", std::int64_t{0});
  b.dtype = j.value("dtype", std::string());
  if (j.contains("shape")) b.shape = j["shape"].get<std::vector<std::int64_t>>();
  return b;
}

Manifest readManifest(const std::string& path) {
  const std::string metaPath = path + "/metadata.json";
  if (!fs::exists(path + "/COMMIT")) {
    throw ConfigError("checkpoint " + path + " is incomplete: it has no COMMIT marker");
  }
  if (!fs::exists(metaPath)) throw ConfigError("checkpoint " + path + ": " + metaPath + " is missing");
  json meta;
  try {
    meta = json::parse(readText(metaPath));
  } catch (const json::exception& e) {
    throw ConfigError("checkpoint " + metaPath + " is malformed: " + e.what());
  }
  return manifestFromMeta(std::move(meta), path);
}

Manifest manifestFromMeta(json meta, const std::string& path) {
  Manifest m;
  m.path = path;
  const std::string metaPath = path + "/metadata.json";
  try {
    m.meta = std::move(meta);
    if (m.meta.at("format").get<std::string>() != kFormat) {
      throw ConfigError("checkpoint " + metaPath + ": not an fsdprun sharded checkpoint");
    }
    if (m.meta.at("format_version").get<int>() > kFormatVersion) {
      throw ConfigError("checkpoint " + metaPath + ": format version " +
                        std::to_string(m.meta.at("format_version").get<int>()) +
                        " is newer than this library's (" + std::to_string(kFormatVersion) + ")");
    }
    const auto& flats = m.meta.at("flats");
    for (std::size_t f = 0; f < flats.size(); ++f) {
      m.flatNumel.push_back(flats[f].at("numel").get<std::int64_t>());
      m.flatDtype.push_back(flats[f].at("dtype").get<std::string>());
      for (const auto& p : flats[f].at("params")) {
        ParamEntry e{p.at("name").get<std::string>(), p.at("shape").get<std::vector<std::int64_t>>(),
                     p.at("offset").get<std::int64_t>(), p.at("numel").get<std::int64_t>(), static_cast<int>(f)};
        m.paramOrder.push_back(e.name);
        m.params[e.name] = std::move(e);
      }
    }
    const auto& files = m.meta.at("files");
    m.files = static_cast<int>(files.size());
    for (const auto& file : files) {
      m.fileBytes.push_back(file.at("bytes").get<std::uint64_t>());
      auto& list = m.blocks.emplace_back();
      for (const auto& b : file.at("blocks")) list.push_back(blockFrom(b));
    }
    if (m.meta.contains("optimizer") && !m.meta["optimizer"].is_null()) {
      m.optimizerKind = m.meta["optimizer"].at("kind").get<std::string>();
      for (const auto& s : m.meta["optimizer"].at("scalars")) {
        m.scalars.push_back(s.get<std::map<std::string, std::int64_t>>());
      }
    }
  } catch (const json::exception& e) {
    throw ConfigError("checkpoint " + metaPath + " is malformed: " + e.what());
  }
  return m;
}

}  // namespace fsdp::worker::detail
