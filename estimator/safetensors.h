// Reads safetensors headers (never the weights) into a ModelInventory: exact names, shapes and
// dtypes of a checkpoint.
//
// File layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON
// {"tensor": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the data. A file of exactly 8 + N bytes is a header without its data (what an HTTP range
// request fetches) and is read as such. The header is validated against the file: N must fit in
// the file and stay under a 100 MiB cap, every data_offsets range must lie inside the data section
// (unless the file is header-only) and match
// numel * dtype size, ranges must not overlap (gaps are harmless and allowed), and a JSON key may
// not repeat. A lying header is
// an error naming the file and tensor, never a crash or a huge allocation. "__metadata__" is
// skipped. Dtypes read: F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 I16 I8 U8 BOOL (others, such as
// U32 or F4, are refused by name).
//
// inventory.name is the path given, inventory.source "safetensors"; model_type and architecture
// stay empty (a header does not say them).
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "estimator/inventory.h"

namespace memplan::estimator {

// The largest safetensors header read (the safetensors library refuses headers above 100 MB; a
// real header is a few MB at most), from a file or fetched from the Hub.
constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;

// One .safetensors file. Tensors are added in header order sorted by data offset. A file that
// holds no tensors is refused (an estimate of nothing would only mislead).
Result<ModelInventory> InventoryFromSafetensorsFile(const std::string& path);

// A sharded checkpoint's model.safetensors.index.json: reads the header of every shard named in
// its weight_map (resolved relative to the index's directory) once, and checks that each tensor
// the map names is in the shard it names. A shard path that is absolute or contains a ".."
// component is refused (symlinks inside the directory are followed, as the Hugging Face cache
// needs). A shard that is absent but has a "<shard>.header" beside it is read from that. Shards are
// read in file-name order; a tensor a shard holds beyond the map is kept, a tensor held by two
// shards is an error.
Result<ModelInventory> InventoryFromSafetensorsIndex(const std::string& index_path);

}  // namespace memplan::estimator
