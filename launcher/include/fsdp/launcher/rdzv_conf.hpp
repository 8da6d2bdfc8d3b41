#pragma once
// `--rdzv_conf k=v,k=v`: the rendezvous settings torchrun users pass, plus ours. Times are in
// seconds, as torchrun's. torchrun's keys that mean nothing here (read_timeout, store_type,
// use_libuv, timeout) and unknown keys (torchrun hands them to custom rendezvous handlers) are
// accepted and ignored, each named in `ignored` for one warning line.

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::launcher {

struct RdzvConf {
  // A node waits this long for its round to form (and for the endpoint to answer).
  std::chrono::milliseconds joinTimeout{600000};
  // With MIN <= nodes < MAX, the round forms this long after MIN nodes arrived.
  std::chrono::milliseconds lastCallTimeout{1000};
  // The hosting agent waits this long for the other agents to say goodbye at the end.
  std::chrono::milliseconds closeTimeout{30000};
  // Agents tell the server they are alive this often; one silent for heartbeatTimeout is
  // dropped from the round (its peers restart without it).
  std::chrono::milliseconds heartbeatInterval{1000};
  std::chrono::milliseconds heartbeatTimeout{5000};
  // Whether this agent hosts the rendezvous server; unset: when the endpoint is this host and
  // its port is free.
  std::optional<bool> isHost;
  // The job token's file (same path on every node); empty: FSDPRUN_TOKEN_FILE, or none.
  std::string tokenFile;
  // Serve PyTorch's TCPStore clients on the rendezvous port even with a token.
  std::optional<bool> allowPytorchClients;
  // An agent that does not host the server carries its workers' store connections on one
  // connection of its own (a store proxy on loopback), so that the server holds one connection
  // per node, not one per rank.
  bool storeProxy = true;

  // Keys accepted and ignored, each "KEY=VALUE: why" (fsdprun warns once per key).
  std::vector<std::string> ignored;

  // Throws ConfigError naming the key or value ("--rdzv_conf 'join_timeout=abc': ...").
  static RdzvConf parse(const std::string& text);
};

}  // namespace fsdp::launcher
