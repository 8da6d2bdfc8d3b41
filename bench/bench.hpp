#pragma once
// fsdp-bench: benchmarks that print one JSON object per line and run their peer (c10d's
// TCPStore, torchrun) in the same invocation, so that ratios hold on a noisy machine.

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace fsdp::bench {

// Flags after the bench name, "--key value" pairs.
class Args {
 public:
  explicit Args(std::map<std::string, std::string> values) : values_(std::move(values)) {}
  // Comma-separated integers ("1,16,256"); throws ConfigError naming the flag.
  std::vector<long long> ints(const std::string& name, const std::string& fallback) const;
  std::string str(const std::string& name, const std::string& fallback) const;

 private:
  std::map<std::string, std::string> values_;
};

struct Bench {
  std::string name;
  std::string help;
  std::vector<std::string> flags;        // the --flags it takes
  std::function<void(const Args&)> run;  // prints JSON lines on stdout
};

void emit(const nlohmann::json& line);

// The path of this fsdp-bench binary (its siblings fsdprun and fsdprun-rdzv live beside it).
std::string selfExe();

// A TCP port free on 127.0.0.1 now (port 0 bound, read back, closed).
std::uint16_t freePort();

// A field of /proc/<pid>/status given in kB ("VmRSS:", "VmHWM:"), in MB; 0 when absent.
double procStatusMb(int pid, const std::string& field);
// Median and percentiles of samples (sorted in place).
double percentile(std::vector<double>& samples, double p);

// Part `index` of `total` split into `parts` nearly equal parts (the share of the clients each
// process of rdzv_join and store_init runs).
inline int shareOf(int total, int parts, int index) { return total / parts + (index < total % parts ? 1 : 0); }

void storeOps(const Args& args);
void rdzvJoin(const Args& args);
void storeInit(const Args& args);
void storeAbuse(const Args& args);
// Hidden subcommands run by the benches in child processes.
int rdzvJoinHelper(std::uint16_t port, int count, int total);
int storeInitHelper(const std::string& server, std::uint16_t port, int count, int total);
int storeInitWireHelper(const std::string& wire, std::uint16_t port, int count, int total);
int c10dServer(bool presized);
void launch(const Args& args);
void restart(const Args& args);
void multiAgent(const Args& args);
void fsdpTrain(const Args& args);
void accuracy(const Args& args);
void recovery(const Args& args);
void hang(const Args& args);
void collectives(const Args& args);
int collectivesWorker(const std::string& mbList, int reps);
void telemetry(const Args& args);
// Hidden: the recorder's hot paths timed in this process (telemetry's micro-benchmark).
int telemetryMicro();

}  // namespace fsdp::bench
