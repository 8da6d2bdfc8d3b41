#include "fsdp/slurm/hostlist.hpp"

#include <algorithm>
#include <cctype>

#include "fsdp/common/env.hpp"
#include "fsdp/common/error.hpp"

namespace fsdp::slurm {
namespace {

[[noreturn]] void invalid(const std::string& expression, const std::string& why) {
  throw ConfigError("invalid hostlist '" + expression + "': " + why);
}

bool allDigits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); });
}

// Expands the inside of one bracket ("0-5,12") into zero-padded numbers.
std::vector<std::string> expandBracket(const std::string& expression, const std::string& body) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= body.size()) {
    const auto end = std::min(body.find(',', start), body.size());
    const std::string part = body.substr(start, end - start);
    const auto dash = part.find('-');
    const std::string lo = part.substr(0, dash);
    const std::string hi = dash == std::string::npos ? lo : part.substr(dash + 1);
    if (!allDigits(lo) || !allDigits(hi)) invalid(expression, "bad range '" + part + "'");
    if (lo.size() > 18 || hi.size() > 18) invalid(expression, "number too long in '" + part + "'");
    const long long a = std::stoll(lo);
    const long long b = std::stoll(hi);
    if (b < a) invalid(expression, "reversed range '" + part + "'");
    if (b - a >= 1'000'000) invalid(expression, "range '" + part + "' is too large");
    const std::size_t width = lo.size();
    for (long long i = a; i <= b; ++i) {
      std::string n = std::to_string(i);
      if (n.size() < width) n.insert(0, width - n.size(), '0');
      out.push_back(std::move(n));
    }
    start = end + 1;
  }
  return out;
}

// Expands one host pattern without top-level commas, e.g. "rack[1-2]-n[01-04]".
std::vector<std::string> expandOne(const std::string& expression, const std::string& pattern) {
  std::vector<std::string> hosts{""};
  std::size_t i = 0;
  while (i < pattern.size()) {
    if (pattern[i] == ']') invalid(expression, "unbalanced ']'");
    if (pattern[i] != '[') {
      const auto next = pattern.find_first_of("[]", i);
      const std::string literal = pattern.substr(i, next - i);
      for (auto& h : hosts) h += literal;
      i = next == std::string::npos ? pattern.size() : next;
      continue;
    }
    const auto close = pattern.find(']', i);
    if (close == std::string::npos) invalid(expression, "unbalanced '['");
    const std::string body = pattern.substr(i + 1, close - i - 1);
    if (body.find('[') != std::string::npos) invalid(expression, "nested '['");
    const auto numbers = expandBracket(expression, body);
    std::vector<std::string> next;
    next.reserve(hosts.size() * numbers.size());
    for (const auto& h : hosts) {
      for (const auto& n : numbers) next.push_back(h + n);
    }
    hosts = std::move(next);
    i = close + 1;
  }
  return hosts;
}

}  // namespace

std::vector<std::string> expandHostlist(const std::string& expression) {
  if (expression.empty()) invalid(expression, "empty");
  std::vector<std::string> hosts;
  int depth = 0;
  std::size_t start = 0;
  for (std::size_t i = 0; i <= expression.size(); ++i) {
    const char c = i < expression.size() ? expression[i] : ',';
    if (c == '[') ++depth;
    if (c == ']' && --depth < 0) invalid(expression, "unbalanced ']'");
    if (c == ',' && depth == 0) {
      const std::string item = expression.substr(start, i - start);
      if (!item.empty()) {
        for (auto& h : expandOne(expression, item)) hosts.push_back(std::move(h));
      }
      start = i + 1;
    }
  }
  if (depth != 0) invalid(expression, "unbalanced '['");
  if (hosts.empty()) invalid(expression, "no host names");
  return hosts;
}

std::vector<int> expandTasksPerNode(const std::string& expression) {
  if (expression.empty()) throw ConfigError("invalid SLURM_TASKS_PER_NODE '': empty");
  std::vector<int> out;
  std::size_t start = 0;
  while (start <= expression.size()) {
    const auto end = std::min(expression.find(',', start), expression.size());
    const std::string part = expression.substr(start, end - start);
    const auto paren = part.find("(x");
    const auto count = parseInt(part.substr(0, paren));
    long long repeat = 1;
    if (paren != std::string::npos) {
      if (part.back() != ')') {
        throw ConfigError("invalid SLURM_TASKS_PER_NODE '" + expression + "': bad part '" + part + "'");
      }
      const auto r = parseInt(part.substr(paren + 2, part.size() - paren - 3));
      repeat = r.value_or(-1);
    }
    if (!count || *count < 0 || repeat < 1 || repeat > 1'000'000) {
      throw ConfigError("invalid SLURM_TASKS_PER_NODE '" + expression + "': bad part '" + part + "'");
    }
    out.insert(out.end(), static_cast<std::size_t>(repeat), static_cast<int>(*count));
    start = end + 1;
  }
  return out;
}

}  // namespace fsdp::slurm
