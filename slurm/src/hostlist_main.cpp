// fsdp-hostlist EXPR: prints one host per line, like `scontrol show hostnames EXPR`.
#include <iostream>

#include "fsdp/common/error.hpp"
#include "fsdp/slurm/hostlist.hpp"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: fsdp-hostlist EXPR   (e.g. fsdp-hostlist 'node[001-004]')\n";
    return 2;
  }
  try {
    for (const auto& host : fsdp::slurm::expandHostlist(argv[1])) std::cout << host << '\n';
  } catch (const fsdp::ConfigError& e) {
    std::cerr << "fsdp-hostlist: " << e.what() << '\n';
    return 2;
  }
  return 0;
}
