#include "fsdp/worker/errors.hpp"

#include <cxxabi.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <ctime>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <typeinfo>

#include "fsdp/common/error.hpp"

namespace fsdp::worker {
namespace {

std::string typeName(const std::exception& e) {
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> name(
      abi::__cxa_demangle(typeid(e).name(), nullptr, nullptr, &status), std::free);
  return status == 0 && name ? name.get() : typeid(e).name();
}

}  // namespace

bool recordError(const std::string& message) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (path == nullptr || *path == '\0') return false;
  const std::string text =
      nlohmann::json{{"message",
                      {{"message", message},
                       {"extraInfo",
                        {{"py_callstack", ""},
                         {"timestamp", std::to_string(static_cast<long long>(std::time(nullptr)))}}}}}}
          .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  // O_EXCL: the first error is the cause; what follows it is usually its consequence.
  const int fd = ::open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  return ok;
}

int runMain(const std::string& program, const std::function<int()>& body) {
  try {
    return body();
  } catch (const ConfigError& e) {
    const std::string message = typeName(e) + ": " + e.what();
    recordError(message);
    std::cerr << program + ": error: " + e.what() + "\n" << std::flush;
    return 2;
  } catch (const std::exception& e) {
    const std::string message = typeName(e) + ": " + e.what();
    recordError(message);
    // One write per line: several ranks share this stderr.
    std::cerr << program + ": error: " + message + "\n" << std::flush;
    return 1;
  }
}

}  // namespace fsdp::worker
