// A blocking HTTP/1.1 test client (http_client.hpp).
#include "http_client.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <vector>

namespace fsdp::testing {
namespace {

using Clock = std::chrono::steady_clock;

int remainingMs(Clock::time_point deadline) {
  return static_cast<int>(std::max<long long>(
      0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count()));
}

}  // namespace

HttpReply httpRequest(const std::string& host, int port, const std::string& method, const std::string& target,
                      std::chrono::milliseconds timeout) {
  HttpReply reply;
  const auto deadline = Clock::now() + timeout;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    reply.error = std::string("socket: ") + std::strerror(errno);
    return reply;
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    reply.error = "not an IPv4 address: " + host;
    return reply;
  }
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 && errno != EINPROGRESS) {
    reply.error = std::string("connect: ") + std::strerror(errno);
    return reply;
  }
  pollfd p{fd, POLLOUT, 0};
  if (::poll(&p, 1, remainingMs(deadline)) != 1) {
    reply.error = "connect timed out";
    return reply;
  }
  int err = 0;
  socklen_t len = sizeof(err);
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    reply.error = std::string("connect: ") + std::strerror(err);
    return reply;
  }
  const std::string request = method + " " + target + " HTTP/1.1\r\nHost: " + host + ":" + std::to_string(port) +
                              "\r\nUser-Agent: fsdp-test\r\nAccept: */*\r\nConnection: close\r\n\r\n";
  std::size_t sent = 0;
  while (sent < request.size()) {
    p = {fd, POLLOUT, 0};
    if (::poll(&p, 1, remainingMs(deadline)) != 1) {
      reply.error = "send timed out";
      return reply;
    }
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR) {
      reply.error = std::string("send: ") + std::strerror(errno);
      return reply;
    }
    if (n > 0) sent += static_cast<std::size_t>(n);
  }
  std::string raw;
  char buffer[65536];
  for (;;) {
    p = {fd, POLLIN, 0};
    if (::poll(&p, 1, remainingMs(deadline)) != 1) {
      reply.error = "reply timed out after " + std::to_string(raw.size()) + " bytes";
      return reply;
    }
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      if (errno == ECONNRESET && !raw.empty()) break;
      reply.error = std::string("recv: ") + std::strerror(errno);
      return reply;
    }
    raw.append(buffer, static_cast<std::size_t>(n));
  }
  const auto headEnd = raw.find("\r\n\r\n");
  if (headEnd == std::string::npos || raw.rfind("HTTP/1.", 0) != 0) {
    reply.error = "malformed reply: " + raw.substr(0, 200);
    return reply;
  }
  std::istringstream head(raw.substr(0, headEnd));
  std::string line;
  std::getline(head, line);
  reply.status = std::atoi(line.substr(line.find(' ') + 1).c_str());
  while (std::getline(head, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
    std::string value = line.substr(colon + 1);
    value.erase(0, value.find_first_not_of(' '));
    reply.headers[name] = value;
  }
  reply.body = raw.substr(headEnd + 4);
  return reply;
}

std::string urlEncode(const std::string& text) {
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  for (const unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

double metricValue(const std::string& page, const std::string& metric, const std::vector<std::string>& labels) {
  std::istringstream in(page);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (line.rfind(metric, 0) != 0) continue;
    const char next = line.size() > metric.size() ? line[metric.size()] : '\0';
    if (next != '{' && next != ' ') continue;
    const auto space = line.rfind(' ');
    const std::string labelText = line.substr(metric.size(), space - metric.size());
    const bool all = std::all_of(labels.begin(), labels.end(),
                                 [&](const std::string& l) {
                                   // rank="2" must not match local_rank="2"
                                   return labelText.find("{" + l) != std::string::npos ||
                                          labelText.find("," + l) != std::string::npos;
                                 });
    if (!all) continue;
    return std::strtod(line.c_str() + space + 1, nullptr);
  }
  return std::numeric_limits<double>::quiet_NaN();
}

}  // namespace fsdp::testing
