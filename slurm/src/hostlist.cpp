#include "fsdp/slurm/hostlist.hpp"

#include <cstdint>
#include <limits>

#include "fsdp/common/env.hpp"
#include "fsdp/common/error.hpp"

namespace fsdp::slurm {
namespace {

// Slurm's own limits (src/common/hostlist.c): MAX_RANGE hosts in one range, MAX_RANGES ranges
// in one bracket group, MAX_PREFIX_CNT hosts in a bracket group that is not the last one.
constexpr std::uint64_t kMaxHostsPerRange = 65536;
constexpr std::size_t kMaxRangesPerBracket = 65536;
constexpr std::uint64_t kMaxHostsPerOuterBracket = 65536;
// Ours: Slurm parses numbers with strtoul and prints garbage once they overflow (or reach
// ULONG_MAX, which it takes for an empty range); 18 significant digits stay far from that.
constexpr std::size_t kMaxSignificantDigits = 18;
// Ours: no cluster has a million nodes; a typo like "n[0-65535]x[0-65535]" must not try to
// allocate four billion strings.
constexpr std::uint64_t kMaxHosts = std::uint64_t{1} << 20;
// SLURM_TASKS_PER_NODE has one entry per node.
constexpr std::uint64_t kMaxNodes = kMaxHosts;

class HostlistParser {
 public:
  explicit HostlistParser(const std::string& expression) : expression_(expression) {}

  std::vector<std::string> expand() {
    if (expression_.empty()) fail("empty expression", std::string::npos);
    std::vector<Item> items;
    std::size_t i = 0;
    while (i < expression_.size()) {
      if (isSeparator(expression_[i])) {
        ++i;
        continue;
      }
      items.push_back(parseItem(i));
    }
    if (items.empty()) fail("no host names, only separators", std::string::npos);

    std::uint64_t total = 0;
    for (const auto& item : items) {
      total += countHosts(item);
      if (total > kMaxHosts) {
        fail("expands to more than " + std::to_string(kMaxHosts) + " hosts", std::string::npos);
      }
    }
    std::vector<std::string> hosts;
    hosts.reserve(static_cast<std::size_t>(total));
    for (const auto& item : items) expandItem(item, hosts);
    return hosts;
  }

 private:
  struct Range {
    std::uint64_t lo = 0;
    std::uint64_t hi = 0;
    std::size_t width = 0;  // of the lower bound as written: the zero padding
  };
  struct Bracket {
    std::vector<Range> ranges;
    std::uint64_t hosts = 0;
  };
  // text[0] bracket[0] text[1] bracket[1] ... text[k]; text[k] is empty when k > 0.
  struct Item {
    std::vector<std::string> text;
    std::vector<Bracket> brackets;
  };

  static bool isSeparator(char c) { return c == ',' || c == ' ' || c == '\t'; }
  static bool isDigit(char c) { return c >= '0' && c <= '9'; }

  [[noreturn]] void fail(const std::string& why, std::size_t position) const {
    std::string where;
    if (position != std::string::npos) where = " at position " + std::to_string(position + 1);
    throw ConfigError("invalid hostlist '" + expression_ + "': " + why + where);
  }

  // Reads one item starting at `i` (not a separator); leaves `i` on the separator or the end.
  Item parseItem(std::size_t& i) {
    Item item;
    item.text.emplace_back();
    while (i < expression_.size() && !isSeparator(expression_[i])) {
      const char c = expression_[i];
      if (c == '[') {
        item.brackets.push_back(parseBracket(i));
        item.text.emplace_back();
        continue;
      }
      if (c == ']') fail("']' without a matching '['", i);
      const auto u = static_cast<unsigned char>(c);
      if (u < 0x20 || u >= 0x7f) fail("character " + describe(u) + " in a host name", i);
      if (!item.brackets.empty()) {
        // Slurm accepts text between bracket groups but not after the last one.
        const std::size_t next = expression_.find_first_of("[], \t", i);
        if (next == std::string::npos || (expression_[next] != '[' && expression_[next] != ']')) {
          fail("text after the last ']' ('" + expression_.substr(i, next - i) +
                   "'): Slurm allows text only before and between bracket groups",
               i);
        }
      }
      item.text.back() += c;
      ++i;
    }
    if (item.brackets.empty()) checkNumericSuffix(item.text.front(), i - item.text.front().size());
    return item;
  }

  static std::string describe(unsigned char u) {
    static const char* const kHex = "0123456789abcdef";
    std::string s = "0x";
    s += kHex[u >> 4];
    s += kHex[u & 15];
    return s;
  }

  // A plain host name is printed back by Slurm after a round trip of its trailing number
  // through strtoul; refuse numbers where that round trip breaks.
  void checkNumericSuffix(const std::string& name, std::size_t start) const {
    std::size_t digits_begin = name.size();
    while (digits_begin > 0 && isDigit(name[digits_begin - 1])) --digits_begin;
    std::size_t first_significant = digits_begin;
    while (first_significant < name.size() && name[first_significant] == '0') ++first_significant;
    if (name.size() - first_significant > kMaxSignificantDigits) {
      fail("number '" + name.substr(digits_begin) + "' in host name '" + name +
               "' is too large (at most " + std::to_string(kMaxSignificantDigits) + " digits)",
           start + digits_begin);
    }
  }

  // Reads "[...]" at `i`; leaves `i` after the ']'.
  Bracket parseBracket(std::size_t& i) {
    const std::size_t open = i;
    const std::size_t close = expression_.find(']', open + 1);
    const std::size_t nested = expression_.find('[', open + 1);
    if (nested != std::string::npos && (close == std::string::npos || nested < close)) {
      fail("'[' inside brackets (the '[' at position " + std::to_string(open + 1) +
               " is not closed before it)",
           nested);
    }
    if (close == std::string::npos) fail("'[' is never closed by a ']'", open);
    Bracket bracket;
    std::size_t start = open + 1;
    for (;;) {
      const std::size_t comma = std::min(expression_.find(',', start), close);
      bracket.ranges.push_back(parseRange(start, comma));
      if (bracket.ranges.size() > kMaxRangesPerBracket) {
        fail("more than " + std::to_string(kMaxRangesPerBracket) + " ranges in one bracket group",
             open);
      }
      bracket.hosts += bracket.ranges.back().hi - bracket.ranges.back().lo + 1;
      if (comma == close) break;
      start = comma + 1;
    }
    i = close + 1;
    return bracket;
  }

  // Parses the range in [begin, end): "N" or "N-N".
  Range parseRange(std::size_t begin, std::size_t end) const {
    const std::string text = expression_.substr(begin, end - begin);
    if (text.empty()) fail("empty range inside brackets", begin);
    const std::size_t dash = text.find('-');
    const std::string lo = text.substr(0, dash);
    const std::string hi = dash == std::string::npos ? lo : text.substr(dash + 1);
    const auto bad = [&](const std::string& why) {
      fail("bad range '" + text + "' (" + why + ")", begin);
    };
    if (lo.empty()) bad("missing lower bound; ranges are N or N-M with numbers >= 0");
    if (hi.empty()) bad("missing upper bound");
    for (const std::string* part : {&lo, &hi}) {
      for (const char c : *part) {
        if (!isDigit(c)) bad("ranges are N or N-M with digits only");
      }
    }
    Range range;
    range.lo = number(lo, text, begin);
    range.hi = number(hi, text, begin);
    range.width = lo.size();
    if (range.hi < range.lo) bad("reversed: the upper bound is below the lower one");
    if (range.hi - range.lo + 1 > kMaxHostsPerRange) {
      bad("more than " + std::to_string(kMaxHostsPerRange) + " hosts, Slurm's limit per range");
    }
    return range;
  }

  std::uint64_t number(const std::string& digits, const std::string& range,
                       std::size_t position) const {
    std::size_t first = 0;
    while (first < digits.size() && digits[first] == '0') ++first;
    if (digits.size() - first > kMaxSignificantDigits) {
      fail("bad range '" + range + "' (number too large: at most " +
               std::to_string(kMaxSignificantDigits) + " digits)",
           position);
    }
    std::uint64_t value = 0;
    for (std::size_t k = first; k < digits.size(); ++k) {
      value = value * 10 + static_cast<std::uint64_t>(digits[k] - '0');
    }
    return value;
  }

  std::uint64_t countHosts(const Item& item) const {
    std::uint64_t count = 1;
    for (std::size_t b = 0; b < item.brackets.size(); ++b) {
      const std::uint64_t hosts = item.brackets[b].hosts;
      if (b + 1 < item.brackets.size() && hosts > kMaxHostsPerOuterBracket) {
        fail("a bracket group before the last one expands to more than " +
                 std::to_string(kMaxHostsPerOuterBracket) + " numbers, Slurm's limit",
             std::string::npos);
      }
      if (hosts != 0 && count > kMaxHosts / hosts) {
        fail("expands to more than " + std::to_string(kMaxHosts) + " hosts", std::string::npos);
      }
      count *= hosts;
    }
    return count;
  }

  static std::string padded(std::uint64_t value, std::size_t width) {
    std::string s = std::to_string(value);
    if (s.size() < width) s.insert(0, width - s.size(), '0');
    return s;
  }

  static std::vector<std::string> numbers(const Bracket& bracket) {
    std::vector<std::string> out;
    out.reserve(static_cast<std::size_t>(bracket.hosts));
    for (const auto& r : bracket.ranges) {
      for (std::uint64_t v = r.lo; v <= r.hi; ++v) out.push_back(padded(v, r.width));
    }
    return out;
  }

  // Slurm substitutes the bracket groups before the last one from right to left, each
  // substitution looping over its numbers, and pushes the last group's ranges innermost.
  static void expandItem(const Item& item, std::vector<std::string>& out) {
    const std::size_t k = item.brackets.size();
    if (k == 0) {
      out.push_back(item.text.front());
      return;
    }
    std::vector<std::vector<std::string>> values;
    values.reserve(k);
    for (const auto& b : item.brackets) values.push_back(numbers(b));
    std::vector<std::size_t> order;  // outermost loop first
    for (std::size_t b = k - 1; b-- > 0;) order.push_back(b);
    order.push_back(k - 1);
    std::vector<const std::string*> chosen(k, nullptr);
    emit(item, values, order, 0, chosen, out);
  }

  static void emit(const Item& item, const std::vector<std::vector<std::string>>& values,
                   const std::vector<std::size_t>& order, std::size_t depth,
                   std::vector<const std::string*>& chosen, std::vector<std::string>& out) {
    if (depth == order.size()) {
      std::string host = item.text[0];
      for (std::size_t b = 0; b < chosen.size(); ++b) {
        host += *chosen[b];
        host += item.text[b + 1];
      }
      out.push_back(std::move(host));
      return;
    }
    for (const auto& v : values[order[depth]]) {
      chosen[order[depth]] = &v;
      emit(item, values, order, depth + 1, chosen, out);
    }
  }

  const std::string& expression_;
};

}  // namespace

std::vector<std::string> expandHostlist(const std::string& expression) {
  return HostlistParser(expression).expand();
}

std::vector<int> expandTasksPerNode(const std::string& expression) {
  const auto invalid = [&](const std::string& why) {
    throw ConfigError("invalid SLURM_TASKS_PER_NODE '" + expression + "': " + why +
                      " (expected counts like '2(x3),1')");
  };
  if (expression.empty()) invalid("empty");
  std::vector<int> out;
  std::size_t start = 0;
  for (;;) {
    const auto end = std::min(expression.find(',', start), expression.size());
    const std::string part = expression.substr(start, end - start);
    const auto paren = part.find("(x");
    const auto count = parseInt(part.substr(0, paren));
    long long repeat = 1;
    if (paren != std::string::npos) {
      if (part.back() != ')') invalid("bad part '" + part + "'");
      repeat = parseInt(part.substr(paren + 2, part.size() - paren - 3)).value_or(-1);
    }
    if (!count || *count < 0 || *count > std::numeric_limits<int>::max() || repeat < 1) {
      invalid("bad part '" + part + "'");
    }
    if (static_cast<std::uint64_t>(repeat) > kMaxNodes - out.size()) {
      invalid("more than " + std::to_string(kMaxNodes) + " nodes");
    }
    out.insert(out.end(), static_cast<std::size_t>(repeat), static_cast<int>(*count));
    if (end == expression.size()) break;
    start = end + 1;
  }
  return out;
}

}  // namespace fsdp::slurm
