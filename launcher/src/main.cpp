// fsdprun: the launcher. Exit codes: 0 success, 1 workers failed after all restarts,
// 2 bad usage, 128+N stopped by signal N.
#include <iostream>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/launcher/agent.hpp"
#include "fsdp/launcher/blas_check.hpp"
#include "fsdp/launcher/options.hpp"

namespace {

void warnAboutReferenceBlas() {
  const auto blas = fsdp::launcher::inspectBlas();
  if (blas.kind == fsdp::launcher::BlasKind::kReference) {
    fsdp::log::warn(
        "libblas.so.3 is the reference BLAS ({}): LibTorch runs about 20x slower on CPU. "
        "Install an optimized one: apt-get install libopenblas0-pthread (scripts/install-deps "
        "does it)",
        blas.path);
  }
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::log::setup({.role = "fsdprun"});
  const auto env = fsdp::processEnv();
  try {
    const auto parsed = fsdp::launcher::parseCommandLine(argc, argv, env);
    if (!parsed.options) {
      std::cout << parsed.message;
      return parsed.exitCode;
    }
    const auto& options = *parsed.options;
    const auto command = fsdp::launcher::workerCommand(options, env);
    if (options.maxNodes > 1 || (!options.standalone && !options.rdzvEndpoint.empty())) {
      throw fsdp::ConfigError(
          "--nnodes " + std::to_string(options.minNodes) + ":" + std::to_string(options.maxNodes) +
          " / --rdzv_endpoint: multi-node rendezvous is not implemented yet; use --standalone "
          "(one node)");
    }
    if (options.dryRun) {
      std::cout << "nnodes: 1 (standalone)\nnproc_per_node: " << options.nprocPerNode
                << "\nmax_restarts: " << options.maxRestarts << "\nrole: " << options.role
                << "\nrdzv_id: " << options.rdzvId << "\ncommand:";
      for (const auto& arg : command) std::cout << ' ' << arg;
      std::cout << '\n';
      return 0;
    }
    warnAboutReferenceBlas();
    const auto result = fsdp::launcher::runStandalone(options, command);
    if (result.exitCode == 1 && result.firstFailure) {
      std::cerr << "fsdprun: error: worker " + fsdp::launcher::describeFailure(*result.firstFailure) +
                       "; " + std::to_string(result.restarts) + " restart(s) of " +
                       std::to_string(options.maxRestarts) + " used\n"
                << std::flush;
    }
    return result.exitCode;
  } catch (const fsdp::ConfigError& e) {
    std::cerr << "fsdprun: error: " + std::string(e.what()) + "\n" << std::flush;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "fsdprun: error: " + std::string(e.what()) + "\n" << std::flush;
    return 1;
  }
}
