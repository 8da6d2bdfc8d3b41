#pragma once
// Blocking loopback connections for tests that send hand-made bytes to a server.

#include <chrono>
#include <cstdint>
#include <vector>

namespace fsdp::testing {

// A connection to 127.0.0.1:port, or -1 when refused. Reads on it give up after
// `receiveTimeout` (so a test waiting for bytes that never come fails instead of hanging).
// `receiveBuffer` > 0 sets SO_RCVBUF before connecting (a client whose kernel absorbs little).
int connectLoopback(std::uint16_t port,
                    std::chrono::milliseconds receiveTimeout = std::chrono::seconds(5),
                    int receiveBuffer = 0);

// Up to `n` bytes: fewer when the peer closes or the receive timeout passes.
std::vector<std::uint8_t> readUpTo(int fd, std::size_t n);

// True when the peer closes `fd` (EOF or reset) within `limit`, whatever it sends first;
// false when it is still open then.
bool closedWithin(int fd, std::chrono::milliseconds limit);

}  // namespace fsdp::testing
