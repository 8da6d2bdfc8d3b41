#pragma once
// Names of the POSIX shared-memory segments of a job ("/fsdprun-<run id>-..."), shared by the
// worker that creates them (libfsdp's shared-memory communicator) and the agent that removes
// what its workers left behind.

#include <string>

namespace fsdp {

// "fsdprun-<run id>-<agent pid>-", the run id reduced to [A-Za-z0-9_.] (others become '_'):
// the prefix of every segment name made by the workers of one agent (their parent) in that
// job, without the leading '/'. Two agents of a job on one host never touch each other's.
std::string shmSegmentPrefix(const std::string& runId, long agentPid);

// Unlinks every segment of those workers still named (in /dev/shm); returns how many.
int removeShmSegments(const std::string& runId, long agentPid);

}  // namespace fsdp
