#pragma once
// What the agents know of a hung job, and the one report made of it: which ranks wait in which
// collective, which never entered it (with their last collective and progress mark), which
// issued different operations at the same sequence number (a desync), and each lagging rank's
// host, pid, process state and stacks. Pure functions over the records: every agent of the job
// builds the same report from the same views. Private to the launcher.

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fsdp/common/flight_ring.hpp"

namespace fsdp::launcher::detail {

// One rank as its agent saw it when the job was declared hung.
struct RankView {
  int rank = -1;
  std::string host;
  long pid = -1;
  bool ringAttached = false;  // false: not a libfsdp program, or it had not reached fsdp::init()
  std::string ringError;      // the ring could not be read (corrupt)
  std::int64_t attachedNs = 0;
  // false: a worker kept from an earlier round for an in-process re-formation that has not
  // re-formed into this one (its ring's last attach is older than the round): it has no records
  // of this round, and the ranks of this round wait for it.
  bool joined = true;
  // Its process is stopped (SIGSTOP, SIGTSTP): it runs no further until SIGCONT, whatever its
  // records say, so the ranks of its round wait for it.
  bool stopped = false;
  std::int64_t lastCompletedNs = 0;
  flight::Progress progress;
  std::vector<flight::Record> records;  // the newest of this round, oldest first
  // Filled for lagging ranks (and every rank of a program without rings).
  std::string state;  // "stopped (SIGSTOP)", ...
  std::string stack;
  std::string stackError;
};

std::string rankViewsToJson(const std::vector<RankView>& views);
// Throws ProtocolError when malformed.
std::vector<RankView> rankViewsFromJson(const std::string& text);

struct HangAnalysis {
  std::set<int> lagging;   // the ranks to take stacks of: the cause, as far as the records tell
  std::vector<std::string> lines;  // the findings, one per line, without stacks
  bool desync = false;
  int cause = -1;  // the index in `lines` of the finding that names the cause; -1: not known
};

// `nowNs`: when the job was declared hung (CLOCK_REALTIME). `worldSize`: every rank the job has;
// ranks without a view (a node that sent nothing) are named as unknown.
HangAnalysis analyzeHang(const std::vector<RankView>& views, int worldSize, std::int64_t nowNs);

// The whole report: a headline, the findings, then each lagging rank's host, pid, state and
// stacks. `headline` says what was seen ("no rank completed a collective ... for 5.0 s").
std::string formatHangReport(const std::string& headline, const HangAnalysis& analysis,
                             const std::vector<RankView>& views);

// "5.7 s"
std::string secondsText(std::int64_t ns);

// "world #57 all_reduce of 1 float (trainer metrics)"
std::string describeRecord(const flight::Record& record);

}  // namespace fsdp::launcher::detail
