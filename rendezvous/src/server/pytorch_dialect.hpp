#pragma once
// PyTorch's TCPStore wire protocol, served on the same port as ours: the 1.13 ("legacy")
// dialect and the current one (VALIDATE + magic, opcodes shifted by one), told apart by the
// first bytes of the connection.

#include <boost/asio.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "fsdp/rendezvous/kv_store.hpp"
#include "fsdp/rendezvous/protocol.hpp"

namespace fsdp::rendezvous {

// Serves one PyTorch client connection, whose first bytes (already read) are `initial`, until
// it closes.
// `closed` tells whether the session was closed from outside; `send` queues reply bytes;
// `room` returns once the client has read enough of them (false: the session closed).
// Throws ProtocolError on malformed input and TimeoutError on a stalled request.
boost::asio::awaitable<void> servePytorchDialect(
    boost::asio::ip::tcp::socket& socket, std::vector<std::uint8_t> initial, KvStore& store,
    const Limits& limits, std::chrono::milliseconds frameTimeout,
    const std::function<bool()>& closed,
    const std::function<void(std::vector<std::uint8_t>)>& send,
    const std::function<boost::asio::awaitable<bool>()>& room);

}  // namespace fsdp::rendezvous
