#pragma once
// A blocking HTTP/1.1 client for tests that scrape /metrics or query Prometheus' API: one
// request per connection, bounded by a timeout.

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "fsdp/common/process.hpp"

namespace fsdp::testing {

struct HttpReply {
  int status = 0;  // 0: no reply (refused, timed out, malformed), `error` says why
  std::string body;
  std::map<std::string, std::string> headers;  // names in lower case
  std::string error;
};

// `target` is the path and query as sent ("/metrics", "/api/v1/query?query=up").
HttpReply httpRequest(const std::string& host, int port, const std::string& method, const std::string& target,
                      std::chrono::milliseconds timeout = std::chrono::seconds(10));
inline HttpReply httpGet(const std::string& host, int port, const std::string& target,
                         std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  return httpRequest(host, port, "GET", target, timeout);
}

// Percent-encodes a query parameter's value.
std::string urlEncode(const std::string& text);

// The value of the sample of `metric` whose labels include every `name="value"` in `labels`
// (e.g. {"rank=\"2\""}) in a Prometheus text page; NaN when there is none.
double metricValue(const std::string& page, const std::string& metric, const std::vector<std::string>& labels = {});

// Scrapes http://127.0.0.1:`port`/metrics until `ready` holds on the page (100 ms between
// scrapes), `job` exits, or `limit` passes. Returns the last page.
template <typename Ready>
std::string scrapeUntil(int port, fsdp::ChildProcess& job, std::chrono::seconds limit, Ready ready) {
  const auto until = std::chrono::steady_clock::now() + limit;
  std::string page;
  while (std::chrono::steady_clock::now() < until) {
    const auto reply = httpGet("127.0.0.1", port, "/metrics");
    if (reply.status == 200) {
      page = reply.body;
      if (ready(page)) return page;
    }
    if (job.waitFor(std::chrono::milliseconds(100))) break;
  }
  return page;
}

}  // namespace fsdp::testing
