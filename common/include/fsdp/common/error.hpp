#pragma once
// The one error hierarchy of fsdprun. Exceptions cross API boundaries; every message says
// what failed, on what, where, and after how long.

#include <stdexcept>
#include <string>

namespace fsdp {

// Base of every error thrown by fsdprun code.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad user input (flags, paths, environment). Tools exit 2 on it.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A bounded wait ran out.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// A socket operation failed; `peer()` names the other end ("host:port").
class NetworkError : public Error {
 public:
  NetworkError(const std::string& what, std::string peer)
      : Error(what), peer_(std::move(peer)) {}
  const std::string& peer() const noexcept { return peer_; }

 private:
  std::string peer_;
};

// The other side sent something that breaks the wire protocol.
class ProtocolError : public Error {
 public:
  using Error::Error;
};

// A collective woken or refused because its communicator was aborted (Communicator::abort):
// the world is re-forming. Recoverable: rebuild the communicators for the new round and go on.
class CommAborted : public Error {
 public:
  using Error::Error;
};

// A training worker failed (exit code or signal).
class WorkerFailure : public Error {
 public:
  WorkerFailure(const std::string& what, int rank, int status)
      : Error(what), rank_(rank), status_(status) {}
  int rank() const noexcept { return rank_; }
  // The raw wait status of the process.
  int status() const noexcept { return status_; }

 private:
  int rank_;
  int status_;
};

// Builds "what: strerror(errno)" for a failed system call.
std::string errnoMessage(const std::string& what, int err);

// Throws NetworkError/Error for a failed system call, with errno's text.
[[noreturn]] void throwErrno(const std::string& what, int err);

}  // namespace fsdp
