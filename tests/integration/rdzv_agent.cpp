// A minimal rendezvous agent for tests: joins, prints each assignment and event as one line,
// heartbeats while it waits, re-joins when a round ends, exits 0 when the run closes.
//   rdzv_agent PORT NODE MIN MAX [--heartbeat_ms 100] [--heartbeat_timeout_ms 1000]
//              [--last_call_ms 300] [--preferred_rank R] [--local_world_size N] [--token T]
#include <cstdio>
#include <string>

#include "fsdp/rendezvous/rdzv_client.hpp"

int main(int argc, char** argv) {
  using namespace fsdp::rendezvous;
  using std::chrono::milliseconds;
  if (argc < 5) {
    std::fprintf(stderr, "usage: rdzv_agent PORT NODE MIN MAX [flags]\n");
    return 2;
  }
  const auto port = static_cast<std::uint16_t>(std::stoi(argv[1]));
  JoinRequest join;
  join.node = argv[2];
  join.address = "127.0.0.1";
  join.minNodes = std::stoi(argv[3]);
  join.maxNodes = std::stoi(argv[4]);
  join.masterPort = 12345;
  milliseconds heartbeat(100);
  std::string token;
  std::string run = "test";
  join.heartbeatTimeout = milliseconds(1000);
  join.lastCallTimeout = milliseconds(300);
  for (int i = 5; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--heartbeat_ms") heartbeat = milliseconds(std::stoi(value));
    else if (flag == "--heartbeat_timeout_ms") join.heartbeatTimeout = milliseconds(std::stoi(value));
    else if (flag == "--last_call_ms") join.lastCallTimeout = milliseconds(std::stoi(value));
    else if (flag == "--preferred_rank") join.preferredRank = std::stoi(value);
    else if (flag == "--local_world_size") join.localWorldSize = std::stoi(value);
    else if (flag == "--token") token = value;
    else if (flag == "--run") run = value;
    else {
      std::fprintf(stderr, "rdzv_agent: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  try {
    auto client = RendezvousClient::connect("127.0.0.1", port, {.connectTimeout = std::chrono::seconds(10), .runId = run, .token = token});
    for (;;) {
      const Assignment a = client->join(join, std::chrono::seconds(60));
      std::printf("ASSIGNED node=%s round=%d node_rank=%d rank_offset=%d world_size=%d nnodes=%d\n",
                  join.node.c_str(), a.round, a.nodeRank, a.rankOffset, a.worldSize, a.nnodes);
      std::fflush(stdout);
      for (;;) {
        const auto event = client->nextEvent(heartbeat);
        if (!event) {
          client->heartbeat();
          continue;
        }
        if (event->kind == EventKind::kRunClosed) {
          std::printf("RUN_CLOSED node=%s reason=%s\n", join.node.c_str(), event->reason.c_str());
          return 0;
        }
        std::printf("ROUND_ENDED node=%s reason=%s\n", join.node.c_str(), event->reason.c_str());
        std::fflush(stdout);
        break;
      }
    }
  } catch (const RunClosedError& e) {
    std::printf("RUN_CLOSED node=%s reason=%s\n", join.node.c_str(), e.what());
    return 0;
  } catch (const std::exception& e) {
    std::printf("ERROR node=%s %s\n", join.node.c_str(), e.what());
    std::fflush(stdout);
    std::fprintf(stderr, "rdzv_agent: %s\n", e.what());
    return 1;
  }
}
