#include "common/suggest.h"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace memplan {
namespace {

const std::vector<std::string> kNames = {"llama-3.1-8b", "llama-3.1-70b", "llama-2-7b",
                                         "qwen3-8b",     "mistral-7b",    "gpt2"};

TEST_CASE("suggest: the closest names, best first, ignoring case and separators") {
  CHECK(ClosestMatches("Llama3_1-8B", kNames).front() == "llama-3.1-8b");
  CHECK(ClosestMatches("lama-3.1-8b", kNames) == std::vector<std::string>{"llama-3.1-8b"});
  // A swap of two neighbours is one edit.
  CHECK(ClosestMatches("mitsral-7b", kNames) == std::vector<std::string>{"mistral-7b"});
  // A prefix suggests every name it starts.
  CHECK(ClosestMatches("llama-3.1", kNames) ==
        std::vector<std::string>{"llama-3.1-8b", "llama-3.1-70b"});
  CHECK(ClosestMatches("qwen3", kNames) == std::vector<std::string>{"qwen3-8b"});
  CHECK(ClosestMatches("bert-base", kNames).empty());
  CHECK(ClosestMatches("", kNames).empty());
  CHECK(ClosestMatches("gpt2", kNames, 1) == std::vector<std::string>{"gpt2"});
}

TEST_CASE("suggest: EditDistance counts insertions, deletions, substitutions and swaps") {
  CHECK(EditDistance("overlap_com", "overlap_comm") == 1);
  CHECK(EditDistance("contigous_gradients", "contiguous_gradients") == 1);
  CHECK(EditDistance("", "abc") == 3);
  CHECK(EditDistance("abc", "") == 3);
  CHECK(EditDistance("kitten", "sitting") == 3);
  CHECK(EditDistance("overlpa_comm", "overlap_comm") == 1);  // a swap
  CHECK(EditDistance("ca", "abc") == 3);     // no edit of a substring twice (not Damerau's 2)
  CHECK(EditDistance("Same", "same") == 1);  // exactly as written: ClosestMatches folds case
}

TEST_CASE("suggest: DidYouMean phrases the list") {
  CHECK(DidYouMean({}).empty());
  CHECK(DidYouMean({"a"}) == " (did you mean a?)");
  CHECK(DidYouMean({"a", "b"}) == " (did you mean a or b?)");
  CHECK(DidYouMean({"a", "b", "c"}) == " (did you mean a, b or c?)");
}

}  // namespace
}  // namespace memplan
