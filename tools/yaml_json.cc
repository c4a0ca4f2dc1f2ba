#include "tools/yaml_json.h"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <regex>
#include <set>
#include <string>

#include "common/printable.h"

namespace memplan::tools {
namespace {

// Note [YAML at the edge]
// The checker (planner/accelerate_check.cc) works on JSON, the form every memplan reader takes;
// Accelerate itself reads a config file that is JSON as well as YAML. Turning YAML into JSON is
// file input, so it lives with the CLI: the libraries memplan installs keep their dependencies
// (yaml-cpp is the CLI's alone), and `pip install .`'s consumers of memplan::planner see no
// change.

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
  Converter(const std::string& source, int max_depth) : source_(source), max_depth_(max_depth) {}

  Status Error(const YAML::Node& node, const std::string& what) const {
    const YAML::Mark mark = node.Mark();
    std::string where = source_;
    if (mark.line >= 0) where += ":" + std::to_string(mark.line + 1);
    return Status::InvalidArgument(where + ": " + what);
  }

  Result<nlohmann::json> Convert(const YAML::Node& node, int depth) {
    if (depth > max_depth_) {
      return Error(node, "nested deeper than " + std::to_string(max_depth_) + " levels");
    }
    // Aliases share nodes: without a bound, nested aliases expand exponentially.
    if (++nodes_ > kMaxNodes) {
      return Error(node, "holds more than " + std::to_string(kMaxNodes) +
                             " values once its aliases are expanded");
    }
    const std::string& tag = node.Tag();
    switch (node.Type()) {
      case YAML::NodeType::Undefined:
      case YAML::NodeType::Null: return nlohmann::json(nullptr);
      case YAML::NodeType::Scalar: return Scalar(node, tag);
      case YAML::NodeType::Sequence: {
        if (tag != "?" && tag != "!" && tag != "tag:yaml.org,2002:seq") return BadTag(node, tag);
        nlohmann::json out = nlohmann::json::array();
        for (const YAML::Node& item : node) {
          MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json value, Convert(item, depth + 1));
          out.push_back(std::move(value));
        }
        return out;
      }
      case YAML::NodeType::Map: {
        if (tag != "?" && tag != "!" && tag != "tag:yaml.org,2002:map") return BadTag(node, tag);
        nlohmann::json out = nlohmann::json::object();
        for (const auto& kv : node) {
          if (!kv.first.IsScalar()) return Error(kv.first, "a key that is not a plain value");
          MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json key_value, Scalar(kv.first, kv.first.Tag()));
          // PyYAML makes `true:` a bool key and `1:` an int key; the JSON form writes them as
          // Python's str() would.
          std::string key = key_value.is_string()    ? key_value.get<std::string>()
                            : key_value.is_boolean() ? (key_value.get<bool>() ? "True" : "False")
                            : key_value.is_null()    ? "None"
                                                     : key_value.dump();
          if (out.contains(key)) {
            return Error(kv.first, "repeats the key '" + Printable(key) +
                                       "' (PyYAML, which Accelerate reads it with, keeps the last "
                                       "value silently); remove one");
          }
          MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json value, Convert(kv.second, depth + 1));
          out[key] = std::move(value);
        }
        return out;
      }
    }
    return Error(node, "a YAML node of an unknown kind");
  }

 private:
  static constexpr int64_t kMaxNodes = 1000000;

  Status BadTag(const YAML::Node& node, const std::string& tag) const {
    return Error(node, "the tag " + Printable(tag) +
                           ", which PyYAML's safe_load (Accelerate's reader) refuses");
  }

  Result<nlohmann::json> Scalar(const YAML::Node& node, const std::string& tag) const {
    const std::string& v = node.Scalar();
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
      if (!plain) return Error(node, "'" + Printable(v) + "' is not a YAML boolean");
    }
    if (plain || tag == "tag:yaml.org,2002:int") {
      if (std::regex_match(v, IntRe())) return Int(node, v);
      if (!plain) return Error(node, "'" + Printable(v) + "' is not a YAML integer");
    }
    if (plain || tag == "tag:yaml.org,2002:float") {
      if (std::regex_match(v, FloatRe())) return Float(node, v);
      if (!plain) return Error(node, "'" + Printable(v) + "' is not a YAML float");
    }
    if (plain) {
      if (v.empty() || v == "~" || v == "null" || v == "Null" || v == "NULL") {
        return nlohmann::json(nullptr);
      }
      return nlohmann::json(v);
    }
    return BadTag(node, tag);
  }

  static std::string Digits(const std::string& v) {
    std::string out;
    for (char c : v) {
      if (c != '_') out += c;
    }
    return out;
  }

  Result<nlohmann::json> Int(const YAML::Node& node, const std::string& text) const {
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
      return Error(node, "the integer " + Printable(text) + " is outside 64 bits");
    }
    if (value == kLimit) return nlohmann::json(std::numeric_limits<int64_t>::min());
    const int64_t magnitude = static_cast<int64_t>(value);
    return nlohmann::json(negative ? -magnitude : magnitude);
  }

  Result<nlohmann::json> Float(const YAML::Node& node, const std::string& text) const {
    std::string v = Digits(text);
    for (char& c : v) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    if (v.find("inf") != std::string::npos || v.find("nan") != std::string::npos) {
      return Error(node, "the float " + Printable(text) +
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
      return Error(node, "the float " + Printable(text) + " overflows a double");
    }
    return nlohmann::json(value);
  }

  const std::string& source_;
  int max_depth_;
  int64_t nodes_ = 0;
};

}  // namespace

Result<nlohmann::json> ParseYamlAsJson(std::string_view text, const std::string& source,
                                       int max_depth) {
  if (text.find('\0') != std::string_view::npos) {
    return Status::InvalidArgument(source + ": not YAML (a NUL byte)");
  }
  // PyYAML reads UTF-8 only; yaml-cpp passes any bytes through, which no JSON can then hold.
  for (size_t i = 0; i < text.size();) {
    uint32_t code = 0;
    const size_t length = DecodeUtf8(text, i, &code);
    if (length == 0) {
      return Status::InvalidArgument(source + ": not YAML: a byte that is not UTF-8 at offset " +
                                     std::to_string(i));
    }
    i += length;
  }
  // yaml-cpp's time grows faster than the size (16 s for 200,000 keys); a config file is a few
  // kilobytes, so a hostile one is refused before parsing.
  if (text.size() > kMaxYamlBytes) {
    return Status::InvalidArgument(source + ": " + std::to_string(text.size()) +
                                   " bytes, more than the " + std::to_string(kMaxYamlBytes) +
                                   " a YAML config may have (an Accelerate config is a few "
                                   "kilobytes)");
  }
  std::vector<YAML::Node> documents;
  try {
    documents = YAML::LoadAll(std::string(text));
  } catch (const YAML::DeepRecursion& e) {
    return Status::InvalidArgument(source + ":" + std::to_string(e.mark.line + 1) +
                                   ": nested deeper than yaml-cpp reads (" +
                                   std::to_string(e.depth()) + " levels)");
  } catch (const YAML::Exception& e) {
    std::string where = source;
    if (e.mark.line >= 0) where += ":" + std::to_string(e.mark.line + 1);
    return Status::InvalidArgument(where + ": not YAML: " + Printable(e.msg));
  } catch (const std::exception& e) {
    return Status::InvalidArgument(source + ": not YAML: " + Printable(e.what()));
  }
  if (documents.size() > 1) {
    return Status::InvalidArgument(source + ": holds " + std::to_string(documents.size()) +
                                   " YAML documents; a config file is one");
  }
  if (documents.empty()) return nlohmann::json(nullptr);
  Converter converter(source, max_depth);
  try {
    return converter.Convert(documents[0], 0);
  } catch (const std::exception& e) {  // yaml-cpp's lazy accessors, std::stod
    return Status::InvalidArgument(source + ": not YAML: " + Printable(e.what()));
  }
}

}  // namespace memplan::tools
