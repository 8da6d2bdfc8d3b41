#include "fashion_mnist.hpp"

#include <ATen/Functions.h>
#include <sys/stat.h>
#include <zlib.h>

#include <cstdint>
#include <vector>

#include "fsdp/common/error.hpp"

namespace fsdp::examples {
namespace {

// Fashion-MNIST training-set statistics.
constexpr float kMean = 0.2860f;
constexpr float kStd = 0.3530f;

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::vector<std::uint8_t> readMaybeGz(const std::string& dir, const std::string& name) {
  std::string path = dir + "/" + name;
  if (!exists(path)) path += ".gz";
  if (!exists(path)) {
    throw ConfigError("--data '" + dir + "': no " + name + " or " + name +
                      ".gz there (expected the Fashion-MNIST IDX files; apt-get install "
                      "dataset-fashion-mnist)");
  }
  gzFile file = ::gzopen(path.c_str(), "rb");
  if (file == nullptr) throw ConfigError("cannot open '" + path + "'");
  std::unique_ptr<gzFile_s, decltype(&::gzclose)> guard(file, ::gzclose);
  std::vector<std::uint8_t> out;
  std::vector<std::uint8_t> chunk(1 << 20);
  for (;;) {
    const int n = ::gzread(file, chunk.data(), static_cast<unsigned>(chunk.size()));
    if (n < 0) throw Error("cannot read '" + path + "': corrupt gzip data");
    if (n == 0) break;
    out.insert(out.end(), chunk.begin(), chunk.begin() + n);
  }
  return out;
}

std::uint32_t bigEndian(const std::vector<std::uint8_t>& b, std::size_t at) {
  return (std::uint32_t{b[at]} << 24) | (std::uint32_t{b[at + 1]} << 16) |
         (std::uint32_t{b[at + 2]} << 8) | std::uint32_t{b[at + 3]};
}

}  // namespace

Dataset loadFashionMnist(const std::string& dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  const std::string imagesName = prefix + "-images-idx3-ubyte";
  const std::string labelsName = prefix + "-labels-idx1-ubyte";
  const auto images = readMaybeGz(dir, imagesName);
  const auto labels = readMaybeGz(dir, labelsName);
  if (images.size() < 16 || bigEndian(images, 0) != 2051) {
    throw Error(dir + "/" + imagesName + ": not an IDX3 image file (bad magic)");
  }
  if (labels.size() < 8 || bigEndian(labels, 0) != 2049) {
    throw Error(dir + "/" + labelsName + ": not an IDX1 label file (bad magic)");
  }
  const std::int64_t n = bigEndian(images, 4);
  const std::int64_t rows = bigEndian(images, 8);
  const std::int64_t cols = bigEndian(images, 12);
  if (rows != 28 || cols != 28 || images.size() != static_cast<std::size_t>(16 + n * rows * cols)) {
    throw Error(dir + "/" + imagesName + ": expected " + std::to_string(n) +
                " images of 28x28, file size does not match");
  }
  if (bigEndian(labels, 4) != n || labels.size() != static_cast<std::size_t>(8 + n)) {
    throw Error(dir + "/" + labelsName + ": label count does not match the " + std::to_string(n) +
                " images");
  }
  Dataset d;
  d.images = at::from_blob(const_cast<std::uint8_t*>(images.data() + 16), {n, 1, 28, 28}, at::kByte)
                 .to(at::kFloat)
                 .div_(255.0)
                 .sub_(kMean)
                 .div_(kStd);
  d.labels = at::from_blob(const_cast<std::uint8_t*>(labels.data() + 8), {n}, at::kByte).to(at::kLong);
  return d;
}

}  // namespace fsdp::examples
