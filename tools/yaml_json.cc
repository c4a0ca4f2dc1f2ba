#include "tools/yaml_json.h"

#include <yaml.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "common/printable.h"

namespace memplan::tools {
namespace {

// Note [YAML at the edge]
// The checker (planner/accelerate_check.cc) works on JSON, the form every memplan reader takes;
// Accelerate itself reads a config file that is JSON as well as YAML. Turning YAML into JSON is
// file input, so it lives with the CLI: the libraries memplan installs keep their dependencies
// (libyaml is the CLI's alone), and `pip install .`'s consumers of memplan::planner see no
// change. libyaml is the parser PyYAML's own C loader uses, fuzzed upstream; yaml-cpp, tried
// first, took minutes and gigabytes on a 482-byte broken flow mapping the fuzzer wrote.

// Note [Plain scalars as PyYAML reads them]
// PyYAML's safe_load resolves an unquoted scalar by YAML 1.1's implicit types (its resolver.py),
// in this order: bool (yes/no/true/false/on/off in three cases), int (0b binary, 0 octal, 0x hex,
// decimal, base-60 with ':'), float (a '.' is needed; an exponent needs its sign: `1.0e+5` is a
// float, `1e5` and `1.0e5` are strings), null (`~`, `null` in three cases, empty), else a string.
// `_` inside digits is ignored. Quoted scalars are strings. Timestamps stay strings here (no
// Accelerate key takes one).
const std::regex& BoolRe() {
  static const std::regex re(
      "yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF");
  return re;
}
const std::regex& IntRe() {
  static const std::regex re(
      "[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+|"
      "[-+]?[1-9][0-9_]*(:[0-5]?[0-9])+");
  return re;
}
const std::regex& FloatRe() {
  static const std::regex re(
      "[-+]?([0-9][0-9_]*)\\.[0-9_]*([eE][-+][0-9]+)?|\\.[0-9][0-9_]*([eE][-+][0-9]+)?|"
      "[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+\\.[0-9_]*|[-+]?\\.(inf|Inf|INF)|\\.(nan|NaN|NAN)");
  return re;
}

class Converter {
 public:
  Converter(std::string_view text, const std::string& source, int max_depth)
      : source_(source), max_depth_(max_depth) {
    yaml_parser_initialize(&parser_);
    yaml_parser_set_input_string(&parser_, reinterpret_cast<const unsigned char*>(text.data()),
                                 text.size());
    yaml_parser_set_encoding(&parser_, YAML_UTF8_ENCODING);
  }
  ~Converter() {
    if (has_event_) yaml_event_delete(&event_);
    yaml_parser_delete(&parser_);
  }
  Converter(const Converter&) = delete;
  Converter& operator=(const Converter&) = delete;

  // The one document of the stream (null when there is none).
  Result<nlohmann::json> Document() {
    MEMPLAN_RETURN_IF_ERROR(Next());  // stream start
    MEMPLAN_RETURN_IF_ERROR(Next());
    if (event_.type == YAML_STREAM_END_EVENT) return nlohmann::json(nullptr);
    MEMPLAN_RETURN_IF_ERROR(Next());  // past the document start
    MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json value, Node(0));
    MEMPLAN_RETURN_IF_ERROR(Next());  // document end
    MEMPLAN_RETURN_IF_ERROR(Next());
    if (event_.type != YAML_STREAM_END_EVENT) {
      return Error(Line(), "holds more than one YAML document; a config file is one");
    }
    return value;
  }

 private:
  Status Error(size_t line, const std::string& what) const {
    return Status::InvalidArgument(source_ + ":" + std::to_string(line) + ": " + what);
  }
  size_t Line() const { return event_.start_mark.line + 1; }

  Status Next() {
    if (has_event_) yaml_event_delete(&event_);
    has_event_ = yaml_parser_parse(&parser_, &event_) != 0;
    if (!has_event_) {
      std::string what = parser_.problem != nullptr ? parser_.problem : "unreadable";
      if (parser_.context != nullptr) what = std::string(parser_.context) + ": " + what;
      return Error(parser_.problem_mark.line + 1, "not YAML: " + Printable(what));
    }
    return Status::Ok();
  }

  static std::string Text(const yaml_char_t* s) {
    return s == nullptr ? std::string() : std::string(reinterpret_cast<const char*>(s));
  }

  Status Count(int64_t nodes, size_t line) {
    // Aliases repeat what an anchor holds: without a bound, nested aliases expand exponentially.
    nodes_ += nodes;
    if (nodes_ > kMaxNodes) {
      return Error(line, "holds more than " + std::to_string(kMaxNodes) +
                             " values once its aliases are expanded");
    }
    return Status::Ok();
  }

  // The node whose first event is event_; event_ is then its last event.
  Result<nlohmann::json> Node(int depth) {
    const size_t line = Line();
    if (depth > max_depth_) {
      return Error(line, "nested deeper than " + std::to_string(max_depth_) + " levels");
    }
    const int64_t before = nodes_;
    MEMPLAN_RETURN_IF_ERROR(Count(1, line));
    std::string anchor;
    nlohmann::json value;
    switch (event_.type) {
      case YAML_ALIAS_EVENT: {
        auto it = anchors_.find(Text(event_.data.alias.anchor));
        if (it == anchors_.end()) {
          return Error(line, "the alias *" + Printable(Text(event_.data.alias.anchor)) +
                                 " names no anchor before it");
        }
        MEMPLAN_RETURN_IF_ERROR(Count(it->second.second, line));
        return it->second.first;
      }
      case YAML_SCALAR_EVENT: {
        anchor = Text(event_.data.scalar.anchor);
        const std::string v(reinterpret_cast<const char*>(event_.data.scalar.value),
                            event_.data.scalar.length);
        const bool plain = event_.data.scalar.style == YAML_PLAIN_SCALAR_STYLE;
        const std::string tag = Text(event_.data.scalar.tag);
        MEMPLAN_ASSIGN_OR_RETURN(value, Scalar(line, v, tag.empty() ? (plain ? "?" : "!") : tag));
        break;
      }
      case YAML_SEQUENCE_START_EVENT: {
        anchor = Text(event_.data.sequence_start.anchor);
        const std::string tag = Text(event_.data.sequence_start.tag);
        if (!tag.empty() && tag != "tag:yaml.org,2002:seq") return BadTag(line, tag);
        value = nlohmann::json::array();
        MEMPLAN_RETURN_IF_ERROR(Next());
        while (event_.type != YAML_SEQUENCE_END_EVENT) {
          MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json item, Node(depth + 1));
          value.push_back(std::move(item));
          MEMPLAN_RETURN_IF_ERROR(Next());
        }
        break;
      }
      case YAML_MAPPING_START_EVENT: {
        anchor = Text(event_.data.mapping_start.anchor);
        const std::string tag = Text(event_.data.mapping_start.tag);
        if (!tag.empty() && tag != "tag:yaml.org,2002:map") return BadTag(line, tag);
        MEMPLAN_ASSIGN_OR_RETURN(value, Mapping(depth));
        break;
      }
      default: return Error(line, "not YAML: an unexpected event");
    }
    if (!anchor.empty()) anchors_[anchor] = {value, nodes_ - before};
    return value;
  }

  // A mapping's pairs up to its end event. PyYAML's merge key `<<` (a mapping or a list of
  // them) adds the keys the mapping does not set itself.
  Result<nlohmann::json> Mapping(int depth) {
    nlohmann::json out = nlohmann::json::object();
    std::vector<nlohmann::json> merges;
    for (;;) {
      MEMPLAN_RETURN_IF_ERROR(Next());
      if (event_.type == YAML_MAPPING_END_EVENT) break;
      const size_t key_line = Line();
      if (event_.type != YAML_SCALAR_EVENT && event_.type != YAML_ALIAS_EVENT) {
        return Error(key_line, "a key that is not a plain value");
      }
      const bool merge =
          event_.type == YAML_SCALAR_EVENT && event_.data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
          event_.data.scalar.tag == nullptr && Text(event_.data.scalar.value) == "<<";
      MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json key_value, Node(depth + 1));
      if (!key_value.is_primitive()) return Error(key_line, "a key that is not a plain value");
      MEMPLAN_RETURN_IF_ERROR(Next());
      MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json value, Node(depth + 1));
      if (merge) {
        if (value.is_object()) {
          merges.push_back(std::move(value));
          continue;
        }
        if (value.is_array() &&
            std::all_of(value.begin(), value.end(), [](const auto& m) { return m.is_object(); })) {
          for (auto& m : value) merges.push_back(std::move(m));
          continue;
        }
        return Error(key_line, "a merge key (<<) takes a mapping or a list of mappings");
      }
      // PyYAML makes `true:` a bool key and `1:` an int key; the JSON form writes them as
      // Python's str() would.
      const std::string key = key_value.is_string()    ? key_value.get<std::string>()
                              : key_value.is_boolean() ? (key_value.get<bool>() ? "True" : "False")
                              : key_value.is_null()    ? "None"
                                                       : key_value.dump();
      if (out.contains(key)) {
        return Error(key_line, "repeats the key '" + Printable(key) +
                                   "' (PyYAML, which Accelerate reads it with, keeps the last "
                                   "value silently); remove one");
      }
      out[key] = std::move(value);
    }
    // The first merged mapping that has a key gives it (PyYAML's flatten_mapping).
    for (const nlohmann::json& m : merges) {
      for (const auto& [k, v] : m.items()) {
        if (!out.contains(k)) out[k] = v;
      }
    }
    return out;
  }

  static constexpr int64_t kMaxNodes = 1000000;

  Status BadTag(size_t line, const std::string& tag) const {
    return Error(line, "the tag " + Printable(tag) +
                           ", which PyYAML's safe_load (Accelerate's reader) refuses");
  }

  Result<nlohmann::json> Scalar(size_t line, const std::string& v, const std::string& tag) const {
    if (tag == "!" || tag == "tag:yaml.org,2002:str") return nlohmann::json(v);
    if (tag == "tag:yaml.org,2002:null") return nlohmann::json(nullptr);
    const bool plain = tag == "?";
    if (plain || tag == "tag:yaml.org,2002:bool") {
      if (std::regex_match(v, BoolRe())) {
        const char c = v[0];
        return nlohmann::json(
            c == 'y' || c == 'Y' || c == 't' || c == 'T' ||
            ((c == 'o' || c == 'O') && v.size() == 2 && (v[1] == 'n' || v[1] == 'N')));
      }
      if (!plain) return Error(line, "'" + Printable(v) + "' is not a YAML boolean");
    }
    if (plain || tag == "tag:yaml.org,2002:int") {
      if (std::regex_match(v, IntRe())) return Int(line, v);
      if (!plain) return Error(line, "'" + Printable(v) + "' is not a YAML integer");
    }
    if (plain || tag == "tag:yaml.org,2002:float") {
      if (std::regex_match(v, FloatRe())) return Float(line, v);
      if (!plain) return Error(line, "'" + Printable(v) + "' is not a YAML float");
    }
    if (plain) {
      if (v.empty() || v == "~" || v == "null" || v == "Null" || v == "NULL") {
        return nlohmann::json(nullptr);
      }
      return nlohmann::json(v);
    }
    return BadTag(line, tag);
  }

  static std::string Digits(const std::string& v) {
    std::string out;
    for (char c : v) {
      if (c != '_') out += c;
    }
    return out;
  }

  Result<nlohmann::json> Int(size_t line, const std::string& text) const {
    std::string v = Digits(text);
    bool negative = false;
    if (!v.empty() && (v[0] == '-' || v[0] == '+')) {
      negative = v[0] == '-';
      v.erase(0, 1);
    }
    // The magnitude, at most 2^63 (INT64_MIN's); anything larger is refused.
    constexpr uint64_t kLimit = uint64_t{1} << 63;
    uint64_t value = 0;
    auto push_to = [&](uint64_t* to, uint64_t base, uint64_t digit) {
      if (digit > kLimit || *to > (kLimit - digit) / base) return false;
      *to = *to * base + digit;
      return true;
    };
    auto push = [&](uint64_t base, uint64_t digit) { return push_to(&value, base, digit); };
    auto digit_of = [](char c) -> unsigned {
      return c >= '0' && c <= '9' ? static_cast<unsigned>(c - '0')
                                  : static_cast<unsigned>((c | 0x20) - 'a' + 10);
    };
    bool ok = true;
    if (v.find(':') != std::string::npos) {  // base 60: 1:30 is 90
      size_t start = 0;
      while (ok && start <= v.size()) {
        const size_t end = std::min(v.find(':', start), v.size());
        uint64_t part = 0;
        for (size_t i = start; ok && i < end; ++i) ok = push_to(&part, 10, digit_of(v[i]));
        ok = ok && push(60, part);
        start = end + 1;
      }
    } else if (v.rfind("0b", 0) == 0 || v.rfind("0x", 0) == 0) {
      const unsigned base = v[1] == 'b' ? 2 : 16;
      for (size_t i = 2; ok && i < v.size(); ++i) ok = push(base, digit_of(v[i]));
    } else {
      const unsigned base = v.size() > 1 && v[0] == '0' ? 8 : 10;
      for (size_t i = 0; ok && i < v.size(); ++i) ok = push(base, digit_of(v[i]));
    }
    if (!ok || (!negative && value == kLimit)) {
      return Error(line, "the integer " + Printable(text) + " is outside 64 bits");
    }
    if (value == kLimit) return nlohmann::json(std::numeric_limits<int64_t>::min());
    const int64_t magnitude = static_cast<int64_t>(value);
    return nlohmann::json(negative ? -magnitude : magnitude);
  }

  Result<nlohmann::json> Float(size_t line, const std::string& text) const {
    std::string v = Digits(text);
    for (char& c : v) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    if (v.find("inf") != std::string::npos || v.find("nan") != std::string::npos) {
      return Error(line, "the float " + Printable(text) +
                             " is not finite (no Accelerate setting takes one)");
    }
    double value = 0;
    if (v.find(':') != std::string::npos) {
      const bool negative = v[0] == '-';
      if (v[0] == '-' || v[0] == '+') v.erase(0, 1);
      size_t start = 0;
      while (start <= v.size()) {
        const size_t end = std::min(v.find(':', start), v.size());
        value = value * 60 + std::stod(v.substr(start, end - start));
        start = end + 1;
      }
      if (negative) value = -value;
    } else {
      if (v == "." || v == "-." || v == "+.") return nlohmann::json(v);  // PyYAML errors; rare
      value = std::stod(v);
    }
    if (!std::isfinite(value)) {
      return Error(line, "the float " + Printable(text) + " overflows a double");
    }
    return nlohmann::json(value);
  }

  const std::string& source_;
  int max_depth_;
  yaml_parser_t parser_;
  yaml_event_t event_;
  bool has_event_ = false;
  int64_t nodes_ = 0;
  std::map<std::string, std::pair<nlohmann::json, int64_t>> anchors_;  // value, its node count
};

}  // namespace

Result<nlohmann::json> ParseYamlAsJson(std::string_view text, const std::string& source,
                                       int max_depth) {
  if (text.find('\0') != std::string_view::npos) {
    return Status::InvalidArgument(source + ": not YAML (a NUL byte)");
  }
  // PyYAML reads UTF-8 only (and no JSON holds other bytes): said here with the offset.
  for (size_t i = 0; i < text.size();) {
    uint32_t code = 0;
    const size_t length = DecodeUtf8(text, i, &code);
    if (length == 0) {
      return Status::InvalidArgument(source + ": not YAML: a byte that is not UTF-8 at offset " +
                                     std::to_string(i));
    }
    i += length;
  }
  // A config file is a few kilobytes: a hostile one is refused before parsing.
  if (text.size() > kMaxYamlBytes) {
    return Status::InvalidArgument(source + ": " + std::to_string(text.size()) +
                                   " bytes, more than the " + std::to_string(kMaxYamlBytes) +
                                   " a YAML config may have (an Accelerate config is a few "
                                   "kilobytes)");
  }
  Converter converter(text, source, max_depth);
  try {
    return converter.Document();
  } catch (const std::exception& e) {  // std::stod, allocation
    return Status::InvalidArgument(source + ": not YAML: " + Printable(e.what()));
  }
}

}  // namespace memplan::tools
