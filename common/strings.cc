#include "common/strings.h"

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

std::string DirName(std::string_view path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

}  // namespace memplan
