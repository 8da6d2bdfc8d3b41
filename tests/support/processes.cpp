#include "processes.hpp"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "fsdp/common/process.hpp"

namespace fsdp::testing {
namespace {

// The fields of /proc/<pid>/stat after the command name: state is [0], pgrp is [2].
std::vector<std::string> statFields(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content;
  if (!std::getline(stat, content)) return {};
  const auto close = content.rfind(')');
  if (close == std::string::npos) return {};
  std::istringstream rest(content.substr(close + 2));
  std::vector<std::string> fields;
  std::string f;
  while (rest >> f) fields.push_back(f);
  return fields;
}

std::vector<int> livePids() {
  std::vector<int> pids;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || !std::isdigit(static_cast<unsigned char>(name[0]))) continue;
    const int pid = std::stoi(name);
    const auto fields = statFields(pid);
    if (!fields.empty() && fields[0] != "Z") pids.push_back(pid);
  }
  return pids;
}

}  // namespace

std::vector<int> waitForPidFiles(const std::string& dir, const std::vector<std::string>& names,
                                 std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    std::vector<int> pids;
    for (const auto& name : names) {
      std::ifstream in(dir + "/" + name + ".pid");
      int pid = 0;
      if (in >> pid) pids.push_back(pid);
    }
    if (pids.size() == names.size()) return pids;
    // Files appear from other processes; there is no event to wait on without inotify, so
    // this bounded wait re-reads a few times a second.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return {};
}

bool processGone(int pid, std::chrono::milliseconds within) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  for (;;) {
    const auto fields = statFields(pid);
    if (fields.empty() || fields[0] == "Z") return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::vector<int> processesWithEnvironment(const std::string& entry) {
  std::vector<int> out;
  for (const int pid : livePids()) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
    std::string var;
    while (std::getline(in, var, '\0')) {
      if (var == entry) {
        out.push_back(pid);
        break;
      }
    }
  }
  return out;
}

std::vector<int> processGroupMembers(int pgid) {
  std::vector<int> out;
  for (const int pid : livePids()) {
    const auto fields = statFields(pid);
    if (fields.size() > 2 && fields[2] == std::to_string(pgid)) out.push_back(pid);
  }
  return out;
}

namespace {
// A TCP socket bound to 127.0.0.1 and a port the kernel chose; the port through `port`.
int boundLoopbackSocket(int& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw std::runtime_error("cannot bind a loopback socket");
  }
  port = ntohs(addr.sin_port);
  return fd;
}
}  // namespace

long procNumber(const std::string& path, const std::string& label) {
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto at = text.find(label);
  if (at == std::string::npos) return -1;
  const auto digits = text.find_first_of("0123456789", at + label.size());
  return digits == std::string::npos ? -1 : std::stol(text.substr(digits));
}

int freeLoopbackPort() {
  int port = 0;
  ::close(boundLoopbackSocket(port));
  return port;
}

SilentListener::SilentListener() : fd_(boundLoopbackSocket(port_)) {
  if (::listen(fd_, 16) != 0) throw std::runtime_error("listen on a loopback socket failed");
}

SilentListener::~SilentListener() { ::close(fd_); }

int parentOf(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(text.substr(close + 2));
  std::string state;
  int ppid = -1;
  rest >> state >> ppid;
  return ppid;
}

bool haveStackTool() {
  std::string why;
  return fsdp::findExecutable("eu-stack", &why) || fsdp::findExecutable("gdb", &why);
}

}  // namespace fsdp::testing
