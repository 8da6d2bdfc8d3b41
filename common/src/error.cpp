#include "fsdp/common/error.hpp"

#include <cstring>

namespace fsdp {

std::string errnoMessage(const std::string& what, int err) {
  return what + ": " + std::strerror(err);
}

void throwErrno(const std::string& what, int err) { throw Error(errnoMessage(what, err)); }

}  // namespace fsdp
