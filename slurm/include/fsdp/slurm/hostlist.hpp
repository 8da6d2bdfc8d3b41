#pragma once
// Slurm hostlist expressions ("tux[0-5,12]", "node[001-128]", "rack[1-2]-n[01-04]", comma
// lists mixing them) expanded to host names in Slurm's order.

#include <string>
#include <vector>

namespace fsdp::slurm {

// Expands an expression. Throws ConfigError naming the expression and the offending part on
// invalid input (unbalanced brackets, reversed or malformed ranges, empty input).
std::vector<std::string> expandHostlist(const std::string& expression);

// Expands SLURM_TASKS_PER_NODE ("2(x3),1" -> 2,2,2,1). Throws ConfigError when malformed.
std::vector<int> expandTasksPerNode(const std::string& expression);

}  // namespace fsdp::slurm
