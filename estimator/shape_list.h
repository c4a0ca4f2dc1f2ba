// Builds a ModelInventory from a tensor-shape list: the route for architectures memplan has no
// config.json builder for. A user dumps it from any PyTorch model, e.g.
//   json.dump({n: list(p.shape) for n, p in model.named_parameters()}, f)
//
// Accepted forms (one JSON document):
//   {"name": [dims...], ...}
//   {"name": {"shape": [dims...], "dtype": "bf16", "tied_to": "other.name"}, ...}
//   [{"name": "...", "shape": [...], "dtype": "...", "tied_to": "..."}, ...]
//   {"tensors": <any of the above>, "model_type": "...", "dtype": "bf16",
//    "tied": {"alias": "canonical"}}
// dtype defaults to F32 (or to the wrapper's "dtype"). A "tied" alias that is not in the list is
// added with its canonical tensor's shape and dtype, because PyTorch's named_parameters() lists a
// shared Parameter once. A tensor may be listed before the one it is tied to.
//
// Refused, with an error naming the source and the tensor ("shapes.json: tensor 'h.0.w': dim 1
// is -3, must be >= 0"): non-integer or negative dims, dims above ConfigReader::kMaxDim, shapes
// whose element count overflows 64 bits, unknown dtypes or entry keys, a tensor listed twice,
// tied_to naming no tensor of the list (or a tie cycle), a list with no tensors, and a list of
// more than kMaxShapeListTensors tensors (the text entry point and LoadModel stop the parse of a
// top-level list at entry kMaxShapeListTensors + 1).
//
// Tensors keep the document's order. nlohmann::json sorts object keys, so the text and
// ordered_json entry points are the ones to use; the nlohmann::json overloads exist for callers
// that already hold a parsed document (they see the tensors in key order).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "estimator/inventory.h"

namespace memplan::estimator {

// The most tensors a shape list may hold (and the most top-level entries of a JSON file given as
// --model): 262,144. The largest real checkpoints list about 10^5 tensors (a
// DeepSeek-V3 or Kimi-K2 index with one tensor per expert and its scales); a list of 10^6
// tensors (18 MiB of text) took 2.7 GiB and 26 s before this cap.
inline constexpr size_t kMaxShapeListTensors = size_t{1} << 18;

// True when `doc` has the shape of a shape list rather than a config.json: a non-empty array of
// objects, the {"tensors": ...} wrapper, or a non-empty object with no string "model_type" whose
// values are all arrays or objects (every config.json has scalar fields such as hidden_size).
// Looks at the top level only, so a malformed shape list still reaches the shape-list reader,
// whose errors are the useful ones, rather than the config.json reader.
bool LooksLikeShapeList(const nlohmann::json& doc);
bool LooksLikeShapeList(const nlohmann::ordered_json& doc);

// inventory.name = `source`, inventory.source = "shape-list", model_type from the wrapper form.
Result<ModelInventory> InventoryFromShapeList(const nlohmann::json& doc, const std::string& source);
Result<ModelInventory> InventoryFromShapeList(const nlohmann::ordered_json& doc,
                                              const std::string& source);
// Parses `text` with ParseOrderedJsonText (nesting limit 64), so a tensor listed twice is an
// error rather than silently dropped.
Result<ModelInventory> InventoryFromShapeListText(std::string_view text, const std::string& source);

}  // namespace memplan::estimator
