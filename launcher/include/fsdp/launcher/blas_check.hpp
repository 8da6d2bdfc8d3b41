#pragma once
// Which BLAS a library path provides. LibTorch on CPU runs ~20x slower on Debian's reference
// BLAS than on OpenBLAS, and which one `libblas.so.3` is depends on the alternatives system.

#include <string>

namespace fsdp::launcher {

enum class BlasKind { kMissing, kReference, kOptimized };

struct BlasInfo {
  BlasKind kind = BlasKind::kMissing;
  std::string path;  // the file actually loaded
  std::string name;  // "OpenBLAS ...", "reference", ...
};

// dlopen()s `library` (default: what the dynamic linker resolves for libblas.so.3) and tells
// an optimized BLAS (OpenBLAS, BLIS, MKL) from the reference one by their exported symbols.
BlasInfo inspectBlas(const std::string& library = "libblas.so.3");

// The same answer without loading the library (loading OpenBLAS starts its thread pool, about
// 10 ms at every fsdprun start): the file the system's libblas.so.3 resolves to, told apart by
// its path (Debian's alternatives: .../blas/ is the reference BLAS, .../openblas*/ OpenBLAS).
// Falls back to inspectBlas() for a path it does not know.
BlasInfo quickInspectBlas();

// Classifies a resolved library path; kMissing when the path says nothing.
BlasInfo classifyBlasPath(const std::string& path);

}  // namespace fsdp::launcher
