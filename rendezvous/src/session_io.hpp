#pragma once
// Socket helpers shared by the server's protocol handlers (private to the rendezvous part).

#include <boost/asio.hpp>

namespace fsdp::rendezvous {

using SteadyTimePoint = boost::asio::steady_timer::clock_type::time_point;

// Reads exactly buffer.size() bytes. What the kernel already holds is taken at once (no timer
// on the hot path); the rest must arrive before `deadline`, else TimeoutError naming `what`.
// Socket errors (EOF included) throw boost::system::system_error. The socket must be in
// non-blocking mode.
boost::asio::awaitable<void> readExact(boost::asio::ip::tcp::socket& socket,
                                       boost::asio::mutable_buffer buffer,
                                       SteadyTimePoint deadline, const char* what);

// Grows the process's descriptor table now to as many descriptors as it may open (at most
// 2^17), so that it does not grow while clients connect: a table shared by threads grows by
// doubling, and every doubling makes the accepting thread wait an RCU grace period
// (milliseconds in a VM) while connections queue. Costs 8 bytes per slot, once. `fd`: any open
// descriptor (duplicated to the top slot and closed again; nothing open is replaced).
void reserveDescriptorTable(int fd);

}  // namespace fsdp::rendezvous
