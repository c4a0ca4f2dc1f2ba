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

}  // namespace

size_t EditDistance(std::string_view a, std::string_view b) {
  // Three rows of the dynamic programme: two back for a swap.
  const size_t m = b.size();
  std::vector<size_t> before(m + 1), previous(m + 1), current(m + 1);
  for (size_t j = 0; j <= m; ++j) previous[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    current[0] = i;
    for (size_t j = 1; j <= m; ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      current[j] = std::min({previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        current[j] = std::min(current[j], before[j - 2] + 1);
      }
    }
    std::swap(before, previous);
    std::swap(previous, current);
  }
  return previous[m];
}

std::vector<std::string> ClosestMatches(std::string_view word,
                                        const std::vector<std::string>& candidates, size_t max) {
  const std::string w = Normalize(word);
  if (w.empty() || w.size() > 128) return {};
  const size_t limit = std::max<size_t>(1, w.size() / 3);
  std::vector<std::pair<size_t, std::string>> scored;
  for (const std::string& c : candidates) {
    const std::string n = Normalize(c);
    if (n.size() > 128) continue;
    size_t d = EditDistance(w, n);
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
