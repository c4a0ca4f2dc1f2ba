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
                                        const std::vector<std::string>& candidates,
                                        size_t max = 3);

// " (did you mean a, b or c?)", or "" when `matches` is empty.
std::string DidYouMean(const std::vector<std::string>& matches);

}  // namespace memplan
