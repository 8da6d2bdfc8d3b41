#include "fsdp/common/prometheus_text.hpp"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <system_error>

namespace fsdp::prom {
namespace {

bool isAsciiLetter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool isAsciiDigit(char c) { return c >= '0' && c <= '9'; }

bool isKnownType(std::string_view type) {
  return type == "counter" || type == "gauge" || type == "untyped" || type == "histogram" ||
         type == "summary";
}

void requireMetricName(std::string_view name) {
  if (!isValidMetricName(name)) {
    throw std::invalid_argument("prometheus: invalid metric name '" + std::string(name) + "'");
  }
}

}  // namespace

bool isValidMetricName(std::string_view name) {
  if (name.empty()) return false;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = isAsciiLetter(c) || c == '_' || c == ':' || (i > 0 && isAsciiDigit(c));
    if (!ok) return false;
  }
  return true;
}

bool isValidLabelName(std::string_view name) {
  if (name.empty()) return false;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = isAsciiLetter(c) || c == '_' || (i > 0 && isAsciiDigit(c));
    if (!ok) return false;
  }
  return true;
}

namespace {

// Backslash and newline escaped; double quotes too in label values (HELP text keeps them).
std::string escape(std::string_view text, bool quotes) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && quotes) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

std::string escapeLabelValue(std::string_view value) { return escape(value, true); }

std::string escapeHelp(std::string_view help) { return escape(help, false); }

std::string formatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  constexpr double kExactIntegers = 9007199254740992.0;  // 2^53: every integer below is exact
  if (std::fabs(value) < kExactIntegers && value == std::trunc(value)) {
    return std::to_string(static_cast<std::int64_t>(value));
  }
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value);
  if (ec != std::errc()) {
    // 64 bytes hold any double's shortest form (at most 24 characters); this cannot happen.
    throw std::logic_error("prometheus: cannot format a double");
  }
  return std::string(buf, end);
}

void TextWriter::family(std::string_view name, std::string_view type, std::string_view help) {
  requireMetricName(name);
  if (!isKnownType(type)) {
    throw std::invalid_argument("prometheus: family '" + std::string(name) + "': unknown type '" +
                                std::string(type) + "'");
  }
  if (!started_.emplace(name).second) {
    throw std::logic_error("prometheus: family '" + std::string(name) + "' started twice");
  }
  current_ = std::string(name);
  text_ += "# HELP ";
  text_ += name;
  text_ += ' ';
  text_ += escapeHelp(help);
  text_ += "\n# TYPE ";
  text_ += name;
  text_ += ' ';
  text_ += type;
  text_ += '\n';
}

void TextWriter::sample(const Labels& labels, double value) {
  if (current_.empty()) throw std::logic_error("prometheus: sample before any family");
  sample(std::string_view(current_), labels, value);
}

void TextWriter::sample(std::string_view suffixedName, const Labels& labels, double value) {
  if (current_.empty()) throw std::logic_error("prometheus: sample before any family");
  requireMetricName(suffixedName);
  if (suffixedName.substr(0, current_.size()) != current_) {
    throw std::invalid_argument("prometheus: sample '" + std::string(suffixedName) +
                                "' is not of the current family '" + current_ + "'");
  }
  // Validate everything before writing, so that a throw leaves the text as it was.
  for (std::size_t i = 0; i < labels.size(); ++i) {
    if (!isValidLabelName(labels[i].name)) {
      throw std::invalid_argument("prometheus: sample '" + std::string(suffixedName) +
                                  "': invalid label name '" + labels[i].name + "'");
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (labels[j].name == labels[i].name) {
        throw std::invalid_argument("prometheus: sample '" + std::string(suffixedName) +
                                    "': label '" + labels[i].name + "' given twice");
      }
    }
  }
  text_ += suffixedName;
  if (!labels.empty()) {
    text_ += '{';
    for (std::size_t i = 0; i < labels.size(); ++i) {
      if (i > 0) text_ += ',';
      text_ += labels[i].name;
      text_ += "=\"";
      text_ += escapeLabelValue(labels[i].value);
      text_ += '"';
    }
    text_ += '}';
  }
  text_ += ' ';
  text_ += formatValue(value);
  text_ += '\n';
}

std::string TextWriter::take() {
  std::string out = std::move(text_);
  text_.clear();
  current_.clear();
  started_.clear();
  return out;
}

}  // namespace fsdp::prom
