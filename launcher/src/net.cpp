#include "fsdp/launcher/net.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>

#include "fsdp/common/env.hpp"
#include "fsdp/common/error.hpp"

namespace fsdp::launcher {
namespace {

// Fills a sockaddr for a numeric host; false when it is not a literal.
bool numericAddress(const std::string& host, int port, sockaddr_storage& out, socklen_t& len) {
  out = {};
  auto* v4 = reinterpret_cast<sockaddr_in*>(&out);
  if (::inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<std::uint16_t>(port));
    len = sizeof(sockaddr_in);
    return true;
  }
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&out);
  if (::inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<std::uint16_t>(port));
    len = sizeof(sockaddr_in6);
    return true;
  }
  return false;
}

std::string addressText(const sockaddr* addr) {
  char text[INET6_ADDRSTRLEN] = {};
  if (addr->sa_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(addr)->sin_addr, text, sizeof(text));
  } else if (addr->sa_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr, text, sizeof(text));
  }
  return text;
}

std::set<std::string> interfaceAddresses() {
  std::set<std::string> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
    if (it->ifa_addr == nullptr) continue;
    if (it->ifa_addr->sa_family != AF_INET && it->ifa_addr->sa_family != AF_INET6) continue;
    out.insert(addressText(it->ifa_addr));
  }
  ::freeifaddrs(list);
  return out;
}

}  // namespace

std::string Endpoint::str() const {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

Endpoint parseEndpoint(const std::string& text, int defaultPort, const std::string& flag) {
  const auto bad = [&](const std::string& why) {
    return ConfigError(flag + " '" + text + "': " + why);
  };
  if (text.empty()) throw bad("expected HOST[:PORT]");
  Endpoint ep;
  std::string port;
  if (text.front() == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos) throw bad("unbalanced '[' (IPv6 addresses go in brackets: [::1]:29400)");
    ep.host = text.substr(1, close - 1);
    const std::string rest = text.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') throw bad("expected ':PORT' after ']'");
      port = rest.substr(1);
      if (port.empty()) throw bad("missing port after ':'");
    }
  } else if (std::count(text.begin(), text.end(), ':') > 1) {
    ep.host = text;  // a bare IPv6 address
  } else {
    const auto colon = text.find(':');
    ep.host = text.substr(0, colon);
    if (colon != std::string::npos) {
      port = text.substr(colon + 1);
      if (port.empty()) throw bad("missing port after ':'");
    }
  }
  if (ep.host.empty()) throw bad("missing host");
  if (port.empty()) {
    ep.port = defaultPort;
  } else {
    const auto n = parseInt(port);
    if (!n || *n < 1 || *n > 65535) throw bad("port '" + port + "' is not a number 1-65535");
    ep.port = static_cast<int>(*n);
  }
  return ep;
}

bool isLoopback(const std::string& host) {
  if (host == "localhost") return true;
  in_addr v4{};
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (::inet_pton(AF_INET6, host.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return false;
}

bool isAddressLiteral(const std::string& host) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  return numericAddress(host, 0, addr, len);
}

bool isThisHost(const std::string& host) {
  if (isLoopback(host) || host == hostName()) return true;
  const auto mine = interfaceAddresses();
  if (isAddressLiteral(host)) return mine.contains(host);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &result) != 0) return false;
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(result, ::freeaddrinfo);
  for (addrinfo* ai = list.get(); ai != nullptr; ai = ai->ai_next) {
    const std::string address = addressText(ai->ai_addr);
    if (mine.contains(address) || isLoopback(address)) return true;
  }
  return false;
}

int freePort(const std::string& host) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  if (!numericAddress(host, 0, addr, len)) numericAddress("127.0.0.1", 0, addr, len);
  const int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throwErrno("socket", errno);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd);
    throwErrno("choosing a free port on " + host, err);
  }
  ::close(fd);
  return ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                          : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

bool portBusy(const std::string& host, int port) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  if (!numericAddress(host, port, addr, len)) numericAddress("0.0.0.0", port, addr, len);
  const int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool busy = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 && errno == EADDRINUSE;
  ::close(fd);
  return busy;
}

std::optional<std::string> portHolder(int port) {
  // The listening socket's inode from /proc/net/tcp{,6} (state 0A = LISTEN), then the process
  // whose fd table holds "socket:[inode]".
  std::set<std::string> inodes;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retrans, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retrans >> uid >> timeout >> inode;
      const auto colon = local.rfind(':');
      if (colon == std::string::npos || state != "0A") continue;
      if (std::stoi(local.substr(colon + 1), nullptr, 16) == port) inodes.insert(inode);
    }
  }
  if (inodes.empty()) return std::nullopt;
  std::error_code ec;
  for (const auto& process : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string pid = process.path().filename().string();
    if (pid.empty() || !std::isdigit(static_cast<unsigned char>(pid[0]))) continue;
    std::error_code fdError;
    for (const auto& fd : std::filesystem::directory_iterator(process.path() / "fd", fdError)) {
      std::error_code linkError;
      const std::string text = std::filesystem::read_symlink(fd.path(), linkError).string();
      if (linkError || !text.starts_with("socket:[")) continue;
      if (inodes.contains(text.substr(8, text.size() - 9))) {
        std::ifstream comm(process.path() / "comm");
        std::string name;
        std::getline(comm, name);
        return "pid " + pid + " (" + name + ")";
      }
    }
  }
  return std::nullopt;
}

std::string hostName() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

}  // namespace fsdp::launcher
