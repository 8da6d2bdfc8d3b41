#include "fsdp/rendezvous/store_client.hpp"

#include <sys/socket.h>

#include <algorithm>
#include <limits>

#include "connection.hpp"
#include "fsdp/common/deadline.hpp"
#include "fsdp/common/error.hpp"

namespace fsdp::rendezvous {

std::unique_ptr<StoreClient> StoreClient::connect(const std::string& host, std::uint16_t port,
                                                  ClientOptions options) {
  auto connection = detail::Connection::open(host, port, options);
  return std::unique_ptr<StoreClient>(new StoreClient(
      std::make_unique<detail::Connection>(std::move(connection)), std::move(options)));
}

StoreClient::StoreClient(std::unique_ptr<detail::Connection> connection, ClientOptions options)
    : connection_(std::move(connection)),
      fd_(connection_->fd()),
      endpoint_(connection_->endpoint()),
      options_(std::move(options)) {}

void StoreClient::reconnect(const std::string& host, std::uint16_t port, ClientOptions options) {
  auto connection = std::make_unique<detail::Connection>(detail::Connection::open(host, port, options));
  std::scoped_lock lock(mutex_);
  connection_->resetOnClose();
  std::swap(connection_, connection);
  fd_ = connection_->fd();
  options_ = std::move(options);
  std::scoped_lock name(endpointMutex_);
  endpoint_ = connection_->endpoint();
}

std::string StoreClient::endpoint() const {
  std::scoped_lock lock(endpointMutex_);
  return endpoint_;
}

void StoreClient::setWaitCheck(std::function<void()> check, std::chrono::milliseconds slice) {
  waitCheck_ = std::move(check);
  waitSlice_ = std::max(slice, std::chrono::milliseconds(1));
}

StoreClient::~StoreClient() {
  // Every request of ours has a reply, and the caller had it (or gave up on it): nothing the
  // server must still read is lost by a reset, and it saves both ends the closing handshake.
  connection_->resetOnClose();
}

Response StoreClient::call(Request request, std::chrono::milliseconds waitTimeout) {
  request.timeoutMs = static_cast<std::uint32_t>(
      std::clamp<long long>(waitTimeout.count(), 0, std::numeric_limits<std::uint32_t>::max()));
  // The server answers a wait by its own timeout; allow time for the reply on top.
  const Deadline deadline = Deadline::after(waitTimeout + std::chrono::seconds(30));
  std::scoped_lock lock(mutex_);
  return connection_->call(request, deadline);
}

Response StoreClient::waitCall(Request request, std::chrono::milliseconds timeout) {
  if (!waitCheck_) return call(std::move(request), timeout);
  const Deadline deadline = Deadline::after(timeout);
  for (;;) {
    waitCheck_();
    const auto left = std::max(deadline.remaining(), std::chrono::milliseconds(0));
    const auto slice = std::min(left, waitSlice_);
    Response resp = call(request, slice);
    if (resp.status != Status::kTimeout || slice == left) return resp;
    // The server added before it waited: the next slices only wait.
    if (request.op == Op::kAddWait) request.number = 0;
  }
}

void StoreClient::interrupt() { ::shutdown(fd_.load(), SHUT_RDWR); }

void StoreClient::set(const std::string& key, const std::string& value) {
  call({.op = Op::kSet, .keys = {key}, .value = value}, std::chrono::milliseconds(0));
}

std::string StoreClient::get(const std::string& key) { return get(key, options_.timeout); }

std::string StoreClient::get(const std::string& key, std::chrono::milliseconds timeout) {
  Response resp = waitCall({.op = Op::kGet, .keys = {key}}, timeout);
  if (resp.status == Status::kTimeout) {
    throw TimeoutError("store.get: key [" + key + "] still missing after " +
                       std::to_string(timeout.count()) + " ms (server " + endpoint() + ")");
  }
  return std::move(resp.value);
}

std::int64_t StoreClient::add(const std::string& key, std::int64_t delta) {
  return call({.op = Op::kAdd, .keys = {key}, .number = delta}, std::chrono::milliseconds(0))
      .number;
}

std::int64_t StoreClient::addAndWait(const std::string& key, std::int64_t delta,
                                     std::int64_t target, std::chrono::milliseconds timeout) {
  const Response resp =
      waitCall({.op = Op::kAddWait, .keys = {key}, .value = std::to_string(target), .number = delta},
               timeout);
  if (resp.status == Status::kTimeout) {
    throw TimeoutError("store.addAndWait: counter [" + key + "] at " + std::to_string(resp.number) +
                       " of " + std::to_string(target) + " after " +
                       std::to_string(timeout.count()) + " ms (server " + endpoint() + ")");
  }
  return resp.number;
}

bool StoreClient::check(const std::vector<std::string>& keys) {
  return call({.op = Op::kCheck, .keys = keys}, std::chrono::milliseconds(0)).number != 0;
}

void StoreClient::wait(const std::vector<std::string>& keys) { wait(keys, options_.timeout); }

void StoreClient::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const Response resp = waitCall({.op = Op::kWait, .keys = keys}, timeout);
  if (resp.status == Status::kTimeout) {
    throw TimeoutError("store.wait: keys [" + resp.value + "] still missing after " +
                       std::to_string(timeout.count()) + " ms (server " + endpoint() + ")");
  }
}

bool StoreClient::remove(const std::string& key) {
  return call({.op = Op::kDelete, .keys = {key}}, std::chrono::milliseconds(0)).number != 0;
}

std::int64_t StoreClient::numKeys() {
  return call({.op = Op::kNumKeys}, std::chrono::milliseconds(0)).number;
}

std::string StoreClient::compareSet(const std::string& key, const std::string& expected,
                                    const std::string& desired) {
  return call({.op = Op::kCompareSet, .keys = {key}, .value = expected, .value2 = desired},
              std::chrono::milliseconds(0))
      .value;
}

std::int64_t StoreClient::append(const std::string& key, const std::string& suffix) {
  return call({.op = Op::kAppend, .keys = {key}, .value = suffix}, std::chrono::milliseconds(0))
      .number;
}

std::vector<std::string> StoreClient::multiGet(const std::vector<std::string>& keys) {
  return call({.op = Op::kMultiGet, .keys = keys}, std::chrono::milliseconds(0)).values;
}

void StoreClient::multiSet(const std::vector<std::string>& keys,
                           const std::vector<std::string>& values) {
  call({.op = Op::kMultiSet, .keys = keys, .values = values}, std::chrono::milliseconds(0));
}

void StoreClient::ping() { call({.op = Op::kPing}, std::chrono::milliseconds(0)); }

std::uint64_t StoreClient::revision() {
  return static_cast<std::uint64_t>(
      call({.op = Op::kRevision}, std::chrono::milliseconds(0)).number);
}

std::optional<KeyChange> StoreClient::waitForChange(const std::vector<std::string>& keys,
                                                    std::uint64_t since,
                                                    std::chrono::milliseconds timeout) {
  if (keys.empty()) throw Error("store.waitForChange: no keys to watch (server " + endpoint() + ")");
  Response resp =
      waitCall({.op = Op::kWatch, .keys = keys, .number = static_cast<std::int64_t>(since)}, timeout);
  if (resp.status == Status::kTimeout) return std::nullopt;
  if (resp.values.size() > 1) {
    throw ProtocolError("store server " + endpoint() + " answered WATCH with " +
                        std::to_string(resp.values.size()) + " values");
  }
  KeyChange change{std::move(resp.value), std::nullopt, static_cast<std::uint64_t>(resp.number)};
  if (!resp.values.empty()) change.value = std::move(resp.values.front());
  return change;
}

}  // namespace fsdp::rendezvous
