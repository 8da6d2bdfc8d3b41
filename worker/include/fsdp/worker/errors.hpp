#pragma once
// How a training program reports why it failed, so that fsdprun's failure report can quote it
// (torchrun's TORCHELASTIC_ERROR_FILE convention, the file PyTorch's @record writes).
//
//   int main(int argc, char** argv) {
//     return fsdp::runMain("train", [&] { return train(argc, argv); });
//   }

#include <functional>
#include <string>

namespace fsdp::worker {

// Writes `message` to the file TORCHELASTIC_ERROR_FILE names, in torchrun's format
// ({"message": {"message": ..., "extraInfo": {...}}}). Returns false when the variable is
// unset or the file cannot be written. The first error recorded wins: a later call (an
// exception during unwinding) does not overwrite it.
bool recordError(const std::string& message);

// Runs `body` and returns its exit code. An exception that escapes it is recorded
// (recordError), printed as one line "<program>: error: <type>: <what>" on stderr, and becomes
// exit code 2 for fsdp::ConfigError (bad usage) or 1 for anything else.
int runMain(const std::string& program, const std::function<int()>& body);

}  // namespace fsdp::worker

namespace fsdp {
using worker::recordError;
using worker::runMain;
}  // namespace fsdp
