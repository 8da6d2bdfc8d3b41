#include "fsdp/launcher/blas_check.hpp"

#include <dlfcn.h>
#include <link.h>

#include <filesystem>

namespace fsdp::launcher {

BlasInfo inspectBlas(const std::string& library) {
  BlasInfo info;
  void* handle = ::dlopen(library.c_str(), RTLD_LAZY | RTLD_LOCAL);
  if (handle == nullptr) return info;
  link_map* map = nullptr;
  if (::dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr) {
    info.path = map->l_name;
  }
  using ConfigFn = const char* (*)();
  if (void* fn = ::dlsym(handle, "openblas_get_config")) {
    info.kind = BlasKind::kOptimized;
    info.name = std::string("OpenBLAS ") + reinterpret_cast<ConfigFn>(fn)();
  } else if (::dlsym(handle, "bli_info_get_version_str") != nullptr) {
    info.kind = BlasKind::kOptimized;
    info.name = "BLIS";
  } else if (::dlsym(handle, "MKL_Get_Version") != nullptr) {
    info.kind = BlasKind::kOptimized;
    info.name = "MKL";
  } else {
    info.kind = BlasKind::kReference;
    info.name = "reference BLAS";
  }
  ::dlclose(handle);
  return info;
}

BlasInfo classifyBlasPath(const std::string& path) {
  BlasInfo info{.path = path};
  const std::string dir = std::filesystem::path(path).parent_path().filename().string();
  if (path.find("openblas") != std::string::npos) {
    info.kind = BlasKind::kOptimized;
    info.name = "OpenBLAS";
  } else if (path.find("blis") != std::string::npos) {
    info.kind = BlasKind::kOptimized;
    info.name = "BLIS";
  } else if (path.find("mkl") != std::string::npos) {
    info.kind = BlasKind::kOptimized;
    info.name = "MKL";
  } else if (dir == "blas") {
    info.kind = BlasKind::kReference;
    info.name = "reference BLAS";
  }
  return info;
}

BlasInfo quickInspectBlas() {
  for (const char* candidate : {"/usr/lib/x86_64-linux-gnu/libblas.so.3",
                                "/usr/lib/aarch64-linux-gnu/libblas.so.3", "/usr/lib64/libblas.so.3",
                                "/usr/lib/libblas.so.3"}) {
    std::error_code ec;
    const auto resolved = std::filesystem::canonical(candidate, ec);
    if (ec) continue;
    const auto info = classifyBlasPath(resolved.string());
    if (info.kind != BlasKind::kMissing) return info;
    return inspectBlas(resolved.string());
  }
  return inspectBlas();
}

}  // namespace fsdp::launcher
