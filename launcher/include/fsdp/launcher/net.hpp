#pragma once
// Addresses and ports for the launcher: `--rdzv_endpoint` parsing, whether a host is this
// machine, free ports, and who holds a busy one.

#include <optional>
#include <string>

namespace fsdp::launcher {

struct Endpoint {
  std::string host;  // without brackets for IPv6
  int port = 0;
  // "host:port", with brackets around an IPv6 host.
  std::string str() const;
};

// Parses HOST, HOST:PORT, [V6] or [V6]:PORT (a bare IPv6 address without brackets is a host
// without a port). `flag` names the flag in errors. Throws ConfigError.
Endpoint parseEndpoint(const std::string& text, int defaultPort, const std::string& flag);

// Whether `host` names this machine: localhost, a loopback address, this host's name, or a
// name or address that resolves to one of this machine's interface addresses.
bool isThisHost(const std::string& host);

// Whether `host` is a numeric loopback address (127.0.0.0/8, ::1) or "localhost".
bool isLoopback(const std::string& host);

// Whether `host` is an IPv4 or IPv6 literal.
bool isAddressLiteral(const std::string& host);

// A TCP port free on `host` (an address literal) right now, chosen by the kernel.
int freePort(const std::string& host = "127.0.0.1");

// Whether something listens on or holds host:port (a bind attempt fails with EADDRINUSE).
bool portBusy(const std::string& host, int port);

// "pid 123 (python3)" for the process listening on TCP `port`, when /proc tells (same user or
// root); nullopt otherwise.
std::optional<std::string> portHolder(int port);

// gethostname(), for node names and messages.
std::string hostName();

}  // namespace fsdp::launcher
