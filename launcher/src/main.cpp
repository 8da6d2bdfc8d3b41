// fsdprun: the launcher. Exit codes: 0 success, 1 the job failed (workers failed after all
// restarts), 2 bad usage, 128+N stopped by signal N.
#include <ctime>
#include <fstream>
#include <iostream>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/launcher/agent.hpp"
#include "fsdp/launcher/blas_check.hpp"
#include "fsdp/launcher/options.hpp"
#include "fsdp/slurm/slurm_env.hpp"

namespace {

// A scheduler that set TORCHELASTIC_ERROR_FILE for the launcher (TorchX does) reads the root
// cause there, as torchrun writes it.
void writeLauncherErrorFile(const fsdp::EnvLookup& env, const fsdp::launcher::Failure& failure) {
  const auto path = env("TORCHELASTIC_ERROR_FILE");
  if (!path || path->empty()) return;
  std::ofstream out(*path, std::ios::trunc);
  out << fsdp::launcher::torchrunErrorJson(failure, static_cast<long long>(std::time(nullptr))) << "\n";
  out.close();
  if (!out) fsdp::log::warn("TORCHELASTIC_ERROR_FILE '{}': could not write the root cause there", *path);
}

void warnAboutReferenceBlas() {
  const auto blas = fsdp::launcher::quickInspectBlas();
  if (blas.kind == fsdp::launcher::BlasKind::kReference) {
    fsdp::log::warn(
        "libblas.so.3 is the reference BLAS ({}): LibTorch runs about 20x slower on CPU. "
        "Install an optimized one: apt-get install libopenblas0-pthread (scripts/install-deps "
        "does it)",
        blas.path);
  }
}

// Each message goes out in one write: workers share the console.
void printError(std::string text) {
  while (!text.empty() && text.back() == '\n') text.pop_back();
  std::cerr << "fsdprun: error: " + text + "\n" << std::flush;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::log::setup({.role = "fsdprun", .defaultLevel = spdlog::level::warn});
  const auto env = fsdp::processEnv();
  try {
    const auto parsed = fsdp::launcher::parseCommandLine(argc, argv, env);
    if (!parsed.options) {
      std::cout << parsed.message;
      return parsed.exitCode;
    }
    const auto& options = *parsed.options;
    for (const auto& warning : options.warnings) fsdp::log::warn("{}", warning);
    const auto command = fsdp::launcher::workerCommand(options, env);
    if (options.dryRun) {
      std::cout << fsdp::launcher::describeConfiguration(options, command);
      return 0;
    }
    // A head node that does not resolve is named now, with the resolver's error, rather than
    // after join_timeout of failed connection attempts.
    if (options.sources.at("rdzv_endpoint").starts_with("Slurm")) {
      if (const auto job = fsdp::slurm::readSlurmJob(env)) fsdp::slurm::resolveHeadNode(*job);
    }
    warnAboutReferenceBlas();
    if (fsdp::launcher::setsOneOmpThread(options, env("OMP_NUM_THREADS").has_value())) {
      // torchrun's own warning, in its words, once per agent.
      fsdp::log::warn(
          "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid "
          "your system being overloaded, please further tune the variable for optimal performance in "
          "your application as needed.");
    }
    const auto result = fsdp::launcher::runAgent(options, command);
    if (result.exitCode == 1) {
      if (result.failure) {
        writeLauncherErrorFile(env, *result.failure);
        printError(fsdp::launcher::describeFailure(*result.failure, options.maxRestarts));
      } else if (!result.message.empty()) {
        printError(result.message);
      }
    } else if (result.exitCode != 0 && !result.message.empty()) {
      fsdp::log::warn("{}", result.message);
    }
    return result.exitCode;
  } catch (const fsdp::ConfigError& e) {
    printError(e.what());
    return 2;
  } catch (const std::exception& e) {
    printError(e.what());
    return 1;
  }
}
