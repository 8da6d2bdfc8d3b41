// How a worker is started: PROGRAM resolved, under Python where torchrun would run it there
// (workerCommand), and whether a program uses libfsdp (--standby).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string_view>

#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/launcher/options.hpp"

namespace fsdp::launcher {

// Whether `path` is a program built with libfsdp: linked statically, it holds the name of the
// variable fsdp::init() waits on as a standby; dynamically, the library's name. Read, never run.
bool usesLibfsdp(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st {};
  bool found = false;
  if (::fstat(fd, &st) == 0 && st.st_size > 0) {
    void* map = ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    if (map != MAP_FAILED) {
      const std::string_view text(static_cast<const char*>(map), static_cast<std::size_t>(st.st_size));
      found = text.find("FSDPRUN_STANDBY_FD") != std::string_view::npos ||
              text.find("libfsdp.so") != std::string_view::npos;
      ::munmap(map, static_cast<std::size_t>(st.st_size));
    }
  }
  ::close(fd);
  return found;
}

namespace {

// Whether `path` is a text file the kernel cannot run itself, neither an ELF program nor a script
// with a "#!" line: torchrun runs every PROGRAM under Python; we run such a file under Python too.
// A file with NUL bytes in its first 512 is data, not a script: refused as not executable.
bool needsInterpreter(const std::string& path) {
  struct stat st {};
  if (path.find('/') == std::string::npos && ::access(path.c_str(), F_OK) != 0) return false;  // a PATH name
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char head[512] = {};
  const auto n = ::read(fd, head, sizeof head);
  ::close(fd);
  if (n < 0) return false;
  const std::string_view text(head, static_cast<std::size_t>(n));
  if (text.starts_with("#!") || text.starts_with("\x7f" "ELF")) return false;
  return text.find('\0') == std::string_view::npos;
}

}  // namespace

std::vector<std::string> workerCommand(const LaunchOptions& options, const EnvLookup& env) {
  const std::string& program = options.command.front();
  const bool python = !options.noPython && (options.module || options.runPath || program.ends_with(".py") ||
                                            needsInterpreter(program));
  std::vector<std::string> argv;
  if (python && options.standby) {
    throw ConfigError("--standby: PROGRAM '" + program + "' runs under Python; a standby worker waits in "
                      "fsdp::init() of a libfsdp program (leave out --standby)");
  }
  if (python) {
    const std::string exec = env("PYTHON_EXEC").value_or("python3");
    std::string why;
    const auto interpreter = findExecutable(exec, &why);
    if (!interpreter) throw ConfigError("PYTHON_EXEC '" + exec + "': " + why);
    argv = {*interpreter, "-u"};
    if (options.module) {
      argv.push_back("-m");
    } else if (::access(program.c_str(), R_OK) != 0) {
      throw ConfigError("PROGRAM '" + program + "': no readable Python script at that path");
    }
    argv.insert(argv.end(), options.command.begin(), options.command.end());
    return argv;
  }
  std::string why;
  const auto resolved = findExecutable(program, &why);
  if (!resolved) {
    throw ConfigError("PROGRAM '" + program + "': " + why + " (expected an executable file)");
  }
  if (options.standby && !usesLibfsdp(*resolved)) {
    throw ConfigError("--standby: PROGRAM '" + program + "' does not use libfsdp; a standby worker waits in "
                      "fsdp::init(), which only a libfsdp program calls (leave out --standby)");
  }
  argv = options.command;
  argv.front() = *resolved;
  return argv;
}

}  // namespace fsdp::launcher
