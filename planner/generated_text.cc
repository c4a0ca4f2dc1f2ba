#include "planner/generated_text.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>

#include "common/printable.h"

namespace memplan::planner {
namespace {

bool PlainShellChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '/' ||
         c == ':' || c == '=' || c == '@' || c == '%' || c == '+' || c == ',' || c == '-';
}

// Words YAML 1.1 (PyYAML) or 1.2 resolves to a boolean or null when plain.
bool YamlKeyword(std::string_view text) {
  static constexpr std::array<std::string_view, 12> kWords = {
      "y", "n", "yes", "no", "true", "false", "on", "off", "null", "nan", "inf", "none"};
  std::string lower;
  for (char c : text) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return std::find(kWords.begin(), kWords.end(), lower) != kWords.end();
}

}  // namespace

std::string ShellQuote(std::string_view text) {
  if (!text.empty() && std::all_of(text.begin(), text.end(), PlainShellChar)) {
    return std::string(text);
  }
  std::string out = "'";
  for (char c : text) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

Result<std::string> ShellWord(std::string_view text, std::string_view what) {
  const size_t bad = text.find_first_of(std::string_view("\0\n\r", 3));
  if (bad != std::string_view::npos) {
    const char c = text[bad];
    return Status::InvalidArgument(std::string(what) + " '" + Printable(text) + "' holds " +
                                   (c == '\0'   ? "a NUL byte"
                                    : c == '\n' ? "a newline"
                                                : "a carriage return") +
                                   ", which a launch command line cannot carry");
  }
  return ShellQuote(text);
}

Status RequireUtf8(std::string_view text, std::string_view what) {
  for (size_t i = 0; i < text.size();) {
    uint32_t code = 0;
    const size_t length = DecodeUtf8(text, i, &code);
    if (length == 0) {
      return Status::InvalidArgument(std::string(what) + ": '" + Printable(text) +
                                     "' is not UTF-8, which a JSON or YAML file cannot hold");
    }
    i += length;
  }
  return Status::Ok();
}

std::string CommentLine(std::string_view text) { return "# " + Printable(text) + "\n"; }

Result<std::string> YamlQuoted(std::string_view v, std::string_view what) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "\"";
  MEMPLAN_RETURN_IF_ERROR(RequireUtf8(v, what));
  for (size_t i = 0; i < v.size();) {
    uint32_t code = 0;
    const size_t length = DecodeUtf8(v, i, &code);
    if (code == '"' || code == '\\') {
      out += '\\';
      out += static_cast<char>(code);
    } else if (code == '\n') {
      out += "\\n";
    } else if (code == '\t') {
      out += "\\t";
    } else if (code < 0x20 || code == 0x7f) {
      out += "\\x";
      out += kHex[code >> 4];
      out += kHex[code & 15];
    } else if (IsInvisibleControl(code)) {
      // C1 (NEL is a line break to YAML 1.1), U+2028/U+2029 (folded into a space inside a
      // double-quoted scalar), the noncharacters a YAML reader refuses: all as \uXXXX.
      out += "\\u";
      for (int shift = 12; shift >= 0; shift -= 4) out += kHex[(code >> shift) & 15];
    } else {
      out.append(v, i, length);
    }
    i += length;
  }
  return out + "\"";
}

Result<std::string> YamlScalar(std::string_view text, std::string_view what) {
  const bool identifier = !text.empty() &&
                          (std::isalpha(static_cast<unsigned char>(text.front())) != 0) &&
                          std::all_of(text.begin(), text.end(), [](char c) {
                            return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_';
                          });
  if (identifier && !YamlKeyword(text)) return std::string(text);
  return YamlQuoted(text, what);
}

}  // namespace memplan::planner
