#pragma once
// Slurm hostlist expressions ("tux[0-5,12]", "node[001-128]", "rack[1-2]-n[01-04]", comma
// lists mixing them) expanded to host names exactly as `scontrol show hostnames` (Slurm
// 22.05) prints them, and SLURM_TASKS_PER_NODE ("2(x3),1") expanded to one count per node.
//
// The grammar accepted (everything else is rejected with a ConfigError):
//   expression := items separated by ',' ' ' or '\t' (empty items, e.g. "a,,b", are skipped)
//   item       := text and bracket groups, e.g. "n1[1-2]", "rack[1-2]-n[01-04]", "[1-2]";
//                 when an item has brackets it must end with ']' (Slurm rejects "n[1-2]x")
//   text       := printable ASCII other than ',' '[' ']' and whitespace
//   bracket    := '[' range {',' range} ']'      range := N | N '-' N   (lo <= hi)
// Numbers are padded with zeros to the width of their lower bound as written
// ("[01-10]" -> 01..10, "[1-010]" -> 1..10, "[001-10]" -> 001..010). Duplicates are kept and
// the order is Slurm's: with several bracket groups the next-to-last group varies slowest,
// then the earlier groups from right to left, the last group fastest ("a[1-2]b[3-4]c[5-6]"
// -> a1b3c5 a1b3c6 a2b3c5 a2b3c6 a1b4c5 ...). Limits are Slurm's: at most 65536 hosts per
// range and per bracket group that is not the last; plus ours: numbers below 10^18, at most
// 1048576 hosts in all.
//
// Where `scontrol` prints something without complaint for input outside this grammar we
// reject it instead, because its output is then not what the user meant: unbalanced
// brackets ("n[1-2" -> "n]"), stray ']' ("n]"), whitespace, signs or letters inside brackets
// ("n[ 1-2]" -> n01 n02, "n[1a-3]" -> n01..n03), a missing upper bound ("n[1-]" -> n1),
// control characters, numbers that overflow (`n99999999999999999999` -> n...18446744073709551615).
//
// Thread-safe (pure functions).

#include <string>
#include <vector>

namespace fsdp::slurm {

// Expands an expression. Throws ConfigError naming the expression, the offending part and
// its position on invalid input (unbalanced brackets, reversed or malformed ranges, empty
// input, limits exceeded).
std::vector<std::string> expandHostlist(const std::string& expression);

// Expands SLURM_TASKS_PER_NODE ("2(x3),1" -> 2,2,2,1). Throws ConfigError when malformed.
std::vector<int> expandTasksPerNode(const std::string& expression);

}  // namespace fsdp::slurm
