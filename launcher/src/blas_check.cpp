#include "fsdp/launcher/blas_check.hpp"

#include <dlfcn.h>
#include <link.h>

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

}  // namespace fsdp::launcher
