#include "common/strings.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>

namespace memplan {

std::string_view LastComponent(std::string_view s, char sep) {
  const size_t at = s.rfind(sep);
  return at == std::string_view::npos ? s : s.substr(at + 1);
}

std::string_view BeforeLastComponent(std::string_view s, char sep) {
  const size_t at = s.rfind(sep);
  return at == std::string_view::npos ? std::string_view() : s.substr(0, at);
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

std::string FormatDouble(const char* format, double v) {
  char text[64];
  std::snprintf(text, sizeof(text), format, v);
  return text;
}

std::string EnvOrEmpty(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? std::string() : std::string(value);
}

std::string DirName(std::string_view path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

}  // namespace memplan
