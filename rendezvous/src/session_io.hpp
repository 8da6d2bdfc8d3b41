#pragma once
// Socket helpers shared by the server's protocol handlers (private to the rendezvous part).

#include <boost/asio.hpp>

namespace fsdp::rendezvous {

using SteadyTimePoint = boost::asio::steady_timer::clock_type::time_point;
// The completion token of every coroutine's asynchronous operation.
inline constexpr auto kUseAwaitable = boost::asio::use_awaitable;

// Reads exactly buffer.size() bytes. What the kernel already holds is taken at once (no timer
// on the hot path); the rest must arrive before `deadline`, else TimeoutError naming `what`.
// Socket errors (EOF included) throw boost::system::system_error. The socket must be in
// non-blocking mode.
boost::asio::awaitable<void> readExact(boost::asio::ip::tcp::socket& socket,
                                       boost::asio::mutable_buffer buffer,
                                       SteadyTimePoint deadline, const char* what);

// Descriptor slots a store server or proxy reserves before it serves (reserveDescriptorTable;
// the soft RLIMIT_NOFILE caps it): 1 MiB of table, once.
inline constexpr std::size_t kDescriptorSlots = std::size_t{1} << 17;

}  // namespace fsdp::rendezvous
