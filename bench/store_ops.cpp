// store_ops: C clients (one thread and one connection each) do set, then get, then add on
// their own keys; throughput and per-operation latency against our store server and against
// LibTorch's c10d::TCPStore server, both in this process, same machine, same run.
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <thread>

#include "bench.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/rendezvous/store_server.hpp"

namespace fsdp::bench {
namespace {

using Clock = std::chrono::steady_clock;

// The three operations, the same for either store.
struct OpsClient {
  std::function<void(const std::string&, const std::string&)> set;
  std::function<void(const std::string&)> get;
  std::function<void(const std::string&)> add;
};

void measure(const std::string& server, std::vector<OpsClient>& clients, long long opsPerClient) {
  const std::string value(16, 'v');
  for (const std::string op : {"set", "get", "add"}) {
    std::vector<std::vector<double>> latencies(clients.size());
    const auto start = Clock::now();
    std::vector<std::thread> threads;
    for (std::size_t c = 0; c < clients.size(); ++c) {
      threads.emplace_back([&, c] {
        auto& lat = latencies[c];
        lat.reserve(static_cast<std::size_t>(opsPerClient));
        for (long long i = 0; i < opsPerClient; ++i) {
          const std::string key = "k/" + std::to_string(c) + "/" + std::to_string(i % 64);
          const auto t0 = Clock::now();
          if (op == "set") clients[c].set(key, value);
          if (op == "get") clients[c].get(key);
          if (op == "add") clients[c].add("n/" + std::to_string(c));
          lat.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        }
      });
    }
    for (auto& t : threads) t.join();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    std::vector<double> all;
    for (auto& l : latencies) all.insert(all.end(), l.begin(), l.end());
    const double total = static_cast<double>(all.size());
    emit({{"bench", "store_ops"},
          {"server", server},
          {"op", op},
          {"clients", clients.size()},
          {"ops", all.size()},
          {"ops_per_s", total / seconds},
          {"p50_us", percentile(all, 0.50)},
          {"p99_us", percentile(all, 0.99)}});
  }
}

}  // namespace

void storeOps(const Args& args) {
  const auto clientCounts = args.ints("clients", "1,16,256");
  const long long totalOps = args.ints("ops", "20000").front();
  for (const long long c : clientCounts) {
    const long long perClient = std::max(10LL, totalOps / c);
    {
      rendezvous::StoreServer server(rendezvous::ServerOptions{});
      std::vector<std::unique_ptr<rendezvous::StoreClient>> owned;
      std::vector<OpsClient> clients;
      for (long long i = 0; i < c; ++i) {
        owned.push_back(rendezvous::StoreClient::connect("127.0.0.1", server.port()));
        auto* client = owned.back().get();
        clients.push_back({[client](const std::string& k, const std::string& v) { client->set(k, v); },
                           [client](const std::string& k) { client->get(k); },
                           [client](const std::string& k) { client->add(k, 1); }});
      }
      measure("fsdprun", clients, perClient);
    }
    {
      c10d::TCPStoreOptions serverOptions;
      serverOptions.port = 0;
      serverOptions.isServer = true;
      serverOptions.waitWorkers = false;
      c10d::TCPStore server("127.0.0.1", serverOptions);
      std::vector<std::unique_ptr<c10d::TCPStore>> owned;
      std::vector<OpsClient> clients;
      for (long long i = 0; i < c; ++i) {
        c10d::TCPStoreOptions o;
        o.port = server.getPort();
        o.isServer = false;
        o.waitWorkers = false;
        owned.push_back(std::make_unique<c10d::TCPStore>("127.0.0.1", o));
        auto* client = owned.back().get();
        clients.push_back(
            {[client](const std::string& k, const std::string& v) {
               client->set(k, std::vector<std::uint8_t>(v.begin(), v.end()));
             },
             [client](const std::string& k) { client->get(k); },
             [client](const std::string& k) { client->add(k, 1); }});
      }
      measure("c10d.TCPStore-1.13", clients, perClient);
    }
  }
}

}  // namespace fsdp::bench
