// "Did you mean ...?": the candidates closest to a word a user typed (a model name, a flag).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace memplan {

// Up to `max` candidates closest to `word`, best first, compared case-insensitively with '-',
// '_', '.' and '/' ignored ("Llama3_1-8B" is "llama-3.1-8b"), by edit distance (a swap of two
// neighbours counts one), keeping those within a third of the word's length (at least 1) and
// candidates that start with the word. Empty when nothing is close.
std::vector<std::string> ClosestMatches(std::string_view word,
                                        const std::vector<std::string>& candidates, size_t max = 3);

// The optimal string alignment distance between `a` and `b`: insertions, deletions,
// substitutions and swaps of two neighbours count one each, exactly as written (no folding).
// O(|a| x |b|) time, O(|b|) memory: callers bound the lengths they compare (ClosestMatches
// ignores words over 128 characters).
size_t EditDistance(std::string_view a, std::string_view b);

// " (did you mean a, b or c?)", or "" when `matches` is empty.
std::string DidYouMean(const std::vector<std::string>& matches);

}  // namespace memplan
