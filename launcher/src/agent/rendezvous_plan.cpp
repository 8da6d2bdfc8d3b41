// The rendezvous plan: from the launch options, where this node meets the others and whether
// it serves the rendezvous itself.
#include "fsdp/launcher/agent.hpp"

#include <string>

#include "fsdp/common/error.hpp"
#include "fsdp/launcher/net.hpp"

namespace fsdp::launcher {
namespace {

constexpr int kDefaultC10dPort = 29400;
constexpr int kDefaultStaticPort = 29500;

}  // namespace

RendezvousPlan planRendezvous(const LaunchOptions& o) {
  RendezvousPlan plan;
  plan.preferredRank = o.nodeRank.value_or(-1);
  const bool staticBackend = o.rdzvBackend == "static";
  const bool singleNode = o.maxNodes == 1 && o.rdzvEndpoint.empty() &&
                          (!staticBackend || o.sources.count("master_addr") == 0 ||
                           o.sources.at("master_addr") == "default");
  // torchrun's recipe for several single-node jobs on one machine: port 0, a free one.
  const bool freePort = o.rdzvEndpoint.ends_with(":0");
  if (freePort && o.maxNodes > 1) {
    throw ConfigError("--rdzv_endpoint '" + o.rdzvEndpoint + "': port 0 (a free port) works for one node only (--nnodes " +
                      std::to_string(o.minNodes) + (o.minNodes == o.maxNodes ? "" : ":" + std::to_string(o.maxNodes)) +
                      " asks for several): the nodes need a port they all know");
  }
  if (o.standalone || singleNode || freePort) {
    plan.embedded = true;
    return plan;
  }
  if (staticBackend) {
    const std::string text = !o.rdzvEndpoint.empty()
                                 ? o.rdzvEndpoint
                                 : o.masterAddr + ":" + std::to_string(o.masterPort.value_or(kDefaultStaticPort));
    plan.endpoint = parseEndpoint(text, kDefaultStaticPort,
                                  o.rdzvEndpoint.empty() ? "--master_addr/--master_port" : "--rdzv_endpoint");
  } else {
    if (o.rdzvEndpoint.empty()) {
      throw ConfigError("--nnodes " + std::to_string(o.minNodes) + ":" + std::to_string(o.maxNodes) +
                        " needs --rdzv_endpoint HOST[:PORT]: where the nodes meet (any node of "
                        "the job, or an fsdprun-rdzv daemon)");
    }
    plan.endpoint = parseEndpoint(o.rdzvEndpoint, kDefaultC10dPort, "--rdzv_endpoint");
  }
  if (o.rdzvConf.isHost) {
    plan.mayHost = plan.mustHost = *o.rdzvConf.isHost;
  } else {
    plan.mayHost = isThisHost(plan.endpoint.host);
  }
  const auto& host = plan.endpoint.host;
  // A literal address is bound as given; a name may resolve here (127.0.1.1 on Debian) to
  // something else than on the other nodes, so every interface listens.
  plan.bindHost = host == "localhost" ? "127.0.0.1" : isAddressLiteral(host) ? host : "::";
  return plan;
}

}  // namespace fsdp::launcher
