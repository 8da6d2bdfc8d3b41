// The hang report: the agents' views of every rank as JSON (what they exchange through the
// rendezvous store), the analysis of the flight records, and the report's text (report.hpp).
#include "report.hpp"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "fsdp/common/error.hpp"

namespace fsdp::launcher::detail {
namespace {

using nlohmann::json;

std::string rankList(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

json recordToJson(const flight::Record& r) {
  return {{"i", r.index}, {"seq", r.seq}, {"group", r.group}, {"gs", r.groupSize}, {"gr", r.groupRank},
          {"op", static_cast<int>(r.op)}, {"count", r.count}, {"dtype", r.dtype}, {"tag", r.tag},
          {"issued", r.issuedNs}, {"started", r.startedNs}, {"completed", r.completedNs},
          {"state", static_cast<int>(r.state)}};
}

flight::Record recordFromJson(const json& j) {
  flight::Record r;
  r.index = j.at("i").get<std::uint64_t>();
  r.seq = j.at("seq").get<std::uint64_t>();
  r.group = j.at("group").get<std::string>();
  r.groupSize = j.at("gs").get<int>();
  r.groupRank = j.at("gr").get<int>();
  r.op = static_cast<flight::Op>(std::clamp(j.at("op").get<int>(), 0, flight::kLastOp));
  r.count = j.at("count").get<std::int64_t>();
  r.dtype = j.at("dtype").get<std::string>();
  r.tag = j.at("tag").get<std::string>();
  r.issuedNs = j.at("issued").get<std::int64_t>();
  r.startedNs = j.at("started").get<std::int64_t>();
  r.completedNs = j.at("completed").get<std::int64_t>();
  r.state = static_cast<flight::SlotState>(std::clamp(j.at("state").get<int>(), 0, 3));
  return r;
}

bool open(const flight::Record& r) { return r.state == flight::SlotState::kIssued; }

std::string signature(const flight::Record& r) {
  // A wait outside a communicator: its count is the step it is for.
  if (r.op == flight::Op::kWait) return "wait at step " + std::to_string(r.count);
  return std::string(flight::opName(r.op)) + " of " + std::to_string(r.count) + (r.dtype.empty() ? "" : " " + r.dtype);
}

}  // namespace

std::string secondsText(std::int64_t ns) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", static_cast<double>(ns) / 1e9);
  return text;
}

std::string describeRecord(const flight::Record& r) {
  if (r.op == flight::Op::kWait) return r.group + " #" + std::to_string(r.seq) + " (" + r.tag + ")";
  std::string out = r.group + " #" + std::to_string(r.seq) + " " + signature(r);
  if (!r.tag.empty()) out += " (" + r.tag + ")";
  return out;
}

std::string rankViewsToJson(const std::vector<RankView>& views) {
  json out = json::array();
  for (const auto& v : views) {
    json records = json::array();
    for (const auto& r : v.records) records.push_back(recordToJson(r));
    out.push_back({{"rank", v.rank}, {"host", v.host}, {"pid", v.pid}, {"attached", v.ringAttached},
                   {"joined", v.joined}, {"stopped", v.stopped},
                   {"ring_error", v.ringError}, {"attached_ns", v.attachedNs}, {"completed_ns", v.lastCompletedNs},
                   {"progress", {{"count", v.progress.count}, {"step", v.progress.step}, {"ns", v.progress.lastNs},
                                 {"gap", v.progress.longestGapNs}, {"what", v.progress.what},
                                 {"busy_since", v.progress.busySinceNs}, {"busy_what", v.progress.busyWhat}}},
                   {"records", std::move(records)}, {"state", v.state}, {"stack", v.stack},
                   {"stack_error", v.stackError}});
  }
  // Text cut mid-character (a tag, a stack) must not make the dump throw.
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::vector<RankView> rankViewsFromJson(const std::string& text) {
  try {
    std::vector<RankView> views;
    for (const auto& j : json::parse(text)) {
      RankView v;
      v.rank = j.at("rank").get<int>();
      v.host = j.at("host").get<std::string>();
      v.pid = j.at("pid").get<long>();
      v.ringAttached = j.at("attached").get<bool>();
      v.joined = j.value("joined", true);
      v.stopped = j.value("stopped", false);
      v.ringError = j.at("ring_error").get<std::string>();
      v.attachedNs = j.at("attached_ns").get<std::int64_t>();
      v.lastCompletedNs = j.at("completed_ns").get<std::int64_t>();
      const auto& p = j.at("progress");
      v.progress = {p.at("count").get<std::int64_t>(), p.at("step").get<std::int64_t>(), p.at("ns").get<std::int64_t>(),
                    p.at("gap").get<std::int64_t>(), p.at("what").get<std::string>(),
                    p.value("busy_since", std::int64_t{0}), p.value("busy_what", std::string())};
      for (const auto& r : j.at("records")) v.records.push_back(recordFromJson(r));
      v.state = j.at("state").get<std::string>();
      v.stack = j.at("stack").get<std::string>();
      v.stackError = j.at("stack_error").get<std::string>();
      views.push_back(std::move(v));
    }
    return views;
  } catch (const json::exception& e) {
    throw ProtocolError(std::string("hang report: malformed rank views: ") + e.what());
  }
}

HangAnalysis analyzeHang(const std::vector<RankView>& views, int worldSize, std::int64_t nowNs) {
  HangAnalysis a;
  std::map<int, const RankView*> byRank;
  for (const auto& v : views) byRank[v.rank] = &v;
  for (int r = 0; r < worldSize; ++r) {
    if (!byRank.count(r)) {
      a.lines.push_back("rank " + std::to_string(r) + ": nothing known (its node sent no records)");
    }
  }
  // A stopped process is stuck, whatever the records could tell (in a new round, before its first
  // collective, there are none): it is the one to name, and those waiting for it are not.
  std::set<int> stopped;
  for (const auto& v : views) {
    if (v.stopped) stopped.insert(v.rank);
  }
  const auto lastProgress = [&](const RankView& v) {
    if (v.progress.count == 0) return std::string("no progress mark yet");
    // A mark without a step (a restore starting) has none to show.
    return "last progress mark: " + v.progress.what +
           (v.progress.step >= 0 ? " " + std::to_string(v.progress.step) : std::string()) + ", " +
           secondsText(nowNs - v.progress.lastNs) + " ago";
  };
  // A survivor kept for an in-process re-formation that never re-formed holds up the whole
  // round: the new processes wait for it inside fsdp::init(), before their rings are attached.
  const bool someNotJoined = std::any_of(views.begin(), views.end(), [](const RankView& v) {
    return v.ringError.empty() && v.ringAttached && !v.joined;
  });
  std::set<int> waitingInInit;  // those new processes: not blamed for the collectives they miss
  for (const auto& v : views) {
    if (!v.ringError.empty()) {
      a.lines.push_back("rank " + std::to_string(v.rank) + ": flight records unreadable: " + v.ringError);
      a.lagging.insert(v.rank);
    } else if (!v.ringAttached && someNotJoined) {
      waitingInInit.insert(v.rank);
      a.lines.push_back("rank " + std::to_string(v.rank) +
                        ": no flight records yet (a new process of this round, not past fsdp::init(), where it waits "
                        "for every rank of the round)");
    } else if (!v.ringAttached) {
      a.lines.push_back("rank " + std::to_string(v.rank) +
                        ": no flight records (not a libfsdp program, or it had not reached fsdp::init())");
      a.lagging.insert(v.rank);
    } else if (!v.joined) {
      // The round waits for it: the cause, in one-line messages too (not the new process
      // listed before it, which waits for it in init()).
      if (a.cause < 0) a.cause = static_cast<int>(a.lines.size());
      a.lines.push_back("rank " + std::to_string(v.rank) +
                        " has not joined this round: it kept its process to re-form in it and has not re-formed; " +
                        lastProgress(v));
      a.lagging.insert(v.rank);
    }
  }
  // A rank inside its own long operation (a checkpoint write) when the job was declared hung.
  for (const auto& v : views) {
    if (v.progress.busySinceNs == 0) continue;
    a.lines.push_back("rank " + std::to_string(v.rank) + " is inside its own " +
                      (v.progress.busyWhat.empty() ? std::string("long operation") : v.progress.busyWhat) +
                      " (waiting for no other rank), for " + secondsText(nowNs - v.progress.busySinceNs));
  }

  // Every group any rank recorded: its members (group rank -> rank) and their records by seq.
  struct Member {
    int rank;
    std::map<std::uint64_t, const flight::Record*> bySeq;
  };
  struct Group {
    int size = 0;
    std::map<int, Member> members;  // by group rank
  };
  std::map<std::string, Group> groups;
  for (const auto& v : views) {
    for (const auto& r : v.records) {
      auto& g = groups[r.group];
      g.size = std::max(g.size, r.groupSize);
      auto& m = g.members.try_emplace(r.groupRank, Member{v.rank, {}}).first->second;
      m.bySeq[r.seq] = &r;
    }
  }
  // A rank waiting in some group is not the cause of another group's wait, even where it is
  // behind there (HYBRID: it waits in its shard group for the rank that stalls).
  std::set<int> waitingSomewhere;
  for (const auto& v : views) {
    for (const auto& r : v.records) {
      if (open(r)) waitingSomewhere.insert(v.rank);
    }
  }
  const auto blame = [&](int rank) {
    if (!waitingSomewhere.count(rank) && !waitingInInit.count(rank)) a.lagging.insert(rank);
  };
  bool anyWaiting = false;
  for (const auto& [name, g] : groups) {
    // Desync: the same sequence number, different operations or sizes.
    std::map<std::uint64_t, std::map<std::string, std::vector<int>>> bySeq;
    for (const auto& [groupRank, m] : g.members) {
      for (const auto& [seq, r] : m.bySeq) bySeq[seq][signature(*r)].push_back(m.rank);
    }
    for (const auto& [seq, signatures] : bySeq) {
      if (signatures.size() < 2) continue;
      a.desync = true;
      std::string line = "desync in " + name + " #" + std::to_string(seq) + ":";
      std::size_t most = 0, atMost = 0;
      for (const auto& [sig, ranks] : signatures) most = std::max(most, ranks.size());
      for (const auto& [sig, ranks] : signatures) atMost += ranks.size() == most ? 1 : 0;
      bool first = true;
      for (const auto& [sig, ranks] : signatures) {
        line += std::string(first ? " " : "; ") + rankList(ranks) + " issued " + sig;
        first = false;
        if (ranks.size() < most || atMost > 1) a.lagging.insert(ranks.begin(), ranks.end());
      }
      a.lines.push_back(line);
      break;  // the first one is the cause; later ones follow from it
    }
    // Where the group is stuck: the lowest sequence number some member has not completed.
    std::optional<std::uint64_t> stuck;
    for (const auto& [groupRank, m] : g.members) {
      for (const auto& [seq, r] : m.bySeq) {
        if (open(*r)) {
          stuck = std::min(stuck.value_or(seq), seq);
          break;
        }
      }
    }
    if (!stuck) continue;
    anyWaiting = true;
    std::vector<int> waiting;
    std::int64_t longest = 0;
    const flight::Record* example = nullptr;
    for (const auto& [groupRank, m] : g.members) {
      const auto it = m.bySeq.find(*stuck);
      if (it == m.bySeq.end() || !open(*it->second)) continue;
      waiting.push_back(m.rank);
      longest = std::max(longest, nowNs - it->second->issuedNs);
      example = it->second;
    }
    a.lines.push_back(rankList(waiting) + (waiting.size() == 1 ? " waits in " : " wait in ") +
                      describeRecord(*example) + " for " + secondsText(longest));
    bool someoneMissing = false;
    for (int groupRank = 0; groupRank < g.size; ++groupRank) {
      const auto it = g.members.find(groupRank);
      if (it == g.members.end()) {
        someoneMissing = true;
        // World groups number their members as the job does; others cannot be told here.
        const bool world = g.size == worldSize;
        if (world && byRank.count(groupRank) && byRank[groupRank]->ringAttached) {
          a.lines.push_back("rank " + std::to_string(groupRank) + " never entered " + name + " #" +
                            std::to_string(*stuck) + ": it has issued nothing in " + name + "; " +
                            lastProgress(*byRank[groupRank]));
        } else if (!world) {
          a.lines.push_back("group rank " + std::to_string(groupRank) + " of " + name + " has issued nothing in it");
        }
        if (world) blame(groupRank);
        continue;
      }
      const Member& m = it->second;
      const auto last = m.bySeq.rbegin();
      if (last->first >= *stuck) continue;
      someoneMissing = true;
      blame(m.rank);
      const flight::Record& r = *last->second;
      std::string line = "rank " + std::to_string(m.rank) + " never entered " + name + " #" + std::to_string(*stuck) +
                         ": its last collective was " + describeRecord(r);
      if (r.completedNs != 0) line += ", completed " + secondsText(nowNs - r.completedNs) + " ago";
      if (waitingSomewhere.count(m.rank)) {
        line += "; it waits in another group itself";
      } else {
        line += "; " + lastProgress(*byRank[m.rank]);
      }
      a.lines.push_back(line);
    }
    // (A stopped rank inside a collective every rank entered makes it look so: it is not.)
    if (!someoneMissing && !a.desync && stopped.empty()) {
      a.lines.push_back("every rank of " + name + " entered #" + std::to_string(*stuck) +
                        " and none completed it: the transport itself is stuck");
      a.lagging.insert(waiting.begin(), waiting.end());
    }
  }
  if (!stopped.empty()) {
    std::vector<int> ranks(stopped.begin(), stopped.end());
    a.lines.insert(a.lines.begin(), rankList(ranks) + (ranks.size() == 1 ? " is stopped (SIGSTOP or SIGTSTP): it runs"
                                                                          : " are stopped (SIGSTOP or SIGTSTP): they run") +
                                        " no further until SIGCONT");
    a.cause = 0;
    // Besides them, only ranks whose records could not be read stay to be looked at.
    for (const auto& v : views) {
      if (!v.ringError.empty()) stopped.insert(v.rank);
    }
    a.lagging = std::move(stopped);
    return a;
  }
  if (!anyWaiting && a.lagging.empty()) {
    a.lines.push_back("no rank waits in a collective: every rank is outside communication (in the program)");
    for (const auto& v : views) a.lagging.insert(v.rank);
  } else if (a.lagging.empty()) {
    // Every rank behind somewhere waits somewhere else: a cycle, or the transport. All of them.
    a.lagging = waitingSomewhere;
  }
  return a;
}

std::string formatHangReport(const std::string& headline, const HangAnalysis& analysis,
                             const std::vector<RankView>& views) {
  std::string out = headline + "\n";
  for (const auto& line : analysis.lines) out += "  " + line + "\n";
  for (const auto& v : views) {
    if (!analysis.lagging.count(v.rank)) continue;
    out += "  rank " + std::to_string(v.rank) + " on " + v.host + ", pid " + std::to_string(v.pid) + ": " +
           (v.state.empty() ? "state unknown" : v.state) + "\n";
    if (!v.stack.empty()) {
      std::size_t begin = 0;
      while (begin < v.stack.size()) {
        const auto end = v.stack.find('\n', begin);
        out += "    " + v.stack.substr(begin, end == std::string::npos ? std::string::npos : end - begin) + "\n";
        if (end == std::string::npos) break;
        begin = end + 1;
      }
    } else if (!v.stackError.empty()) {
      out += "    no stack: " + v.stackError + "\n";
    }
  }
  return out;
}

}  // namespace fsdp::launcher::detail
