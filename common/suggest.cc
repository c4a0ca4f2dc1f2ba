#include "common/suggest.h"

#include <algorithm>
#include <cctype>
#include <utility>

namespace memplan {
namespace {

std::string Normalize(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '-' || c == '_' || c == '.' || c == '/') continue;
    out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  return out;
}

// Optimal string alignment distance (Damerau-Levenshtein without repeated edits of a substring).
size_t Distance(const std::string& a, const std::string& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= m; ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[n][m];
}

}  // namespace

std::vector<std::string> ClosestMatches(std::string_view word,
                                        const std::vector<std::string>& candidates, size_t max) {
  const std::string w = Normalize(word);
  if (w.empty() || w.size() > 128) return {};
  const size_t limit = std::max<size_t>(1, w.size() / 3);
  std::vector<std::pair<size_t, std::string>> scored;
  for (const std::string& c : candidates) {
    const std::string n = Normalize(c);
    if (n.size() > 128) continue;
    size_t d = Distance(w, n);
    if (n.rfind(w, 0) == 0 && w.size() >= 3) d = std::min<size_t>(d, 1);  // a prefix
    if (d <= limit) scored.emplace_back(d, c);
  }
  std::stable_sort(scored.begin(), scored.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  std::vector<std::string> out;
  for (const auto& [d, c] : scored) {
    if (out.size() == max) break;
    if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  }
  return out;
}

std::string DidYouMean(const std::vector<std::string>& matches) {
  if (matches.empty()) return "";
  std::string out = " (did you mean ";
  for (size_t i = 0; i < matches.size(); ++i) {
    if (i > 0) out += i + 1 == matches.size() ? " or " : ", ";
    out += matches[i];
  }
  return out + "?)";
}

}  // namespace memplan
