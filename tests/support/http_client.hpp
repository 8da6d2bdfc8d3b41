#pragma once
// A blocking HTTP/1.1 client for tests that scrape /metrics or query Prometheus' API: one
// request per connection, bounded by a timeout.

#include <chrono>
#include <map>
#include <string>
#include <vector>

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

}  // namespace fsdp::testing
