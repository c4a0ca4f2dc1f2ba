#include "estimator/safetensors.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/testing.h"
#include "tests/status_testing.h"

namespace memplan::estimator {
namespace {

namespace fs = std::filesystem;

using testing::TempDir;

// Prefix of each test case's scratch directory.
constexpr std::string_view kTempPrefix = "memplan_safetensors_";

std::string LittleEndian64(uint64_t v) {
  std::string out(8, '\0');
  for (size_t i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  REQUIRE(f.good());
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f.good());
}

// A file laid out exactly as safetensors writes it: length, header, `data_bytes` zero bytes.
// `claimed_length` replaces the true header length when a test wants the prefix to lie.
void WriteRaw(const std::string& path, const std::string& header, uint64_t data_bytes,
              std::optional<uint64_t> claimed_length = std::nullopt) {
  WriteBytes(path, LittleEndian64(claimed_length.value_or(header.size())) + header +
                       std::string(data_bytes, '\0'));
}

struct Spec {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
};

int BytesPerElement(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64") return 8;
  if (dtype == "F32" || dtype == "I32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16") return 2;
  return 1;
}

// A well-formed file: tensors packed in the order given, header padded with spaces to a
// multiple of 8 as the safetensors library does.
void WriteSafetensors(const std::string& path, const std::vector<Spec>& specs) {
  // Built as text: ordered_json's operator[] searches linearly, too slow for tens of thousands of
  // tensors.
  std::string text = R"({"__metadata__":{"format":"pt"})";
  uint64_t offset = 0;
  for (const Spec& s : specs) {
    uint64_t bytes = static_cast<uint64_t>(BytesPerElement(s.dtype));
    for (int64_t d : s.shape) bytes *= static_cast<uint64_t>(d);
    nlohmann::json entry = {
        {"dtype", s.dtype}, {"shape", s.shape}, {"data_offsets", {offset, offset + bytes}}};
    text += "," + nlohmann::json(s.name).dump() + ":" + entry.dump();
    offset += bytes;
  }
  text += "}";
  text.append((8 - text.size() % 8) % 8, ' ');
  WriteRaw(path, text, offset);
}

std::vector<std::string> Names(const ModelInventory& inv) {
  std::vector<std::string> out;
  for (const TensorInfo& t : inv.tensors) out.push_back(t.name);
  return out;
}

std::string FileError(const std::string& path) {
  auto inv = InventoryFromSafetensorsFile(path);
  return inv.ok() ? std::string("<no error>") : inv.status().message();
}

std::string IndexError(const std::string& path) {
  auto inv = InventoryFromSafetensorsIndex(path);
  return inv.ok() ? std::string("<no error>") : inv.status().message();
}

bool StartsWith(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

TEST_CASE("source: safetensors file gives exact names, shapes and dtypes in offset order") {
  TempDir dir(kTempPrefix);
  const std::string path = dir.PathOf("model.safetensors");
  // Header order differs from data order: the inventory follows the data.
  const std::string header =
      R"({"__metadata__": {"format": "pt"},)"
      R"("lm_head.weight": {"dtype": "BF16", "shape": [16, 8], "data_offsets": [552, 808]},)"
      R"("model.embed_tokens.weight":)"
      R"( {"dtype": "BF16", "shape": [16, 8], "data_offsets": [0, 256]},)"
      R"("model.layers.0.mlp.up_proj.weight":)"
      R"( {"dtype": "F32", "shape": [8, 4], "data_offsets": [256, 384]},)"
      R"("model.layers.0.mlp.up_proj.scale":)"
      R"( {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [384, 388]},)"
      R"("model.layers.1.mask": {"dtype": "BOOL", "shape": [3], "data_offsets": [388, 391]},)"
      R"("model.layers.1.step": {"dtype": "I64", "shape": [], "data_offsets": [392, 400]},)"
      R"("model.norm.weight": {"dtype": "F16", "shape": [8], "data_offsets": [400, 416]},)"
      R"("model.rotary.inv_freq": {"dtype": "F64", "shape": [17], "data_offsets": [416, 552]}})";
  WriteRaw(path, header, 808);

  auto inv = InventoryFromSafetensorsFile(path);
  INFO(inv.status().ToString());
  REQUIRE_OK(inv);
  CHECK(inv->source == "safetensors");
  CHECK(inv->name == path);
  CHECK(Names(*inv) ==
        std::vector<std::string>{"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                                 "model.layers.0.mlp.up_proj.scale", "model.layers.1.mask",
                                 "model.layers.1.step", "model.norm.weight",
                                 "model.rotary.inv_freq", "lm_head.weight"});
  const auto& t = inv->tensors;
  CHECK(t[0].shape == std::vector<int64_t>{16, 8});
  CHECK(t[0].dtype == DType::kBF16);
  CHECK(t[1].dtype == DType::kF32);
  CHECK(t[1].layer == 0);
  CHECK(t[1].module == "model.layers.0.mlp.up_proj");
  CHECK(t[2].dtype == DType::kF8E4M3);
  CHECK(t[3].dtype == DType::kBool);
  CHECK(t[3].layer == 1);
  CHECK(t[4].dtype == DType::kI64);
  CHECK(t[4].shape.empty());
  CHECK(t[5].dtype == DType::kF16);
  CHECK(t[6].dtype == DType::kF64);
  auto counts = CountParams(*inv);
  REQUIRE_OK(counts);
  CHECK(counts->params_total == 128 + 32 + 4 + 3 + 1 + 8 + 17 + 128);
  CHECK(counts->num_tensors == 8);
  CHECK(counts->num_blocks == 2);
  // Every byte of the data section but the one alignment gap at 391.
  CHECK(counts->bytes_as_stored == 808 - 1);
}

TEST_CASE("source: safetensors reads every supported dtype") {
  TempDir dir(kTempPrefix);
  const std::vector<std::pair<std::string, DType>> dtypes = {
      {"F64", DType::kF64},   {"F32", DType::kF32},        {"F16", DType::kF16},
      {"BF16", DType::kBF16}, {"I64", DType::kI64},        {"I32", DType::kI32},
      {"I16", DType::kI16},   {"I8", DType::kI8},          {"U8", DType::kU8},
      {"BOOL", DType::kBool}, {"F8_E4M3", DType::kF8E4M3}, {"F8_E5M2", DType::kF8E5M2},
  };
  std::vector<Spec> specs;
  uint64_t bytes = 0;
  for (const auto& [name, dtype] : dtypes) {
    specs.push_back({"t." + name, name, {2, 3}});
    bytes += 6 * static_cast<uint64_t>(BytesPerElement(name));
  }
  const std::string path = dir.PathOf("all.safetensors");
  WriteSafetensors(path, specs);
  auto inv = InventoryFromSafetensorsFile(path);
  INFO(inv.status().ToString());
  REQUIRE_OK(inv);
  REQUIRE(inv->tensors.size() == dtypes.size());
  for (size_t i = 0; i < dtypes.size(); ++i) {
    CHECK(inv->tensors[i].name == "t." + dtypes[i].first);
    CHECK(inv->tensors[i].dtype == dtypes[i].second);
    CHECK(inv->tensors[i].numel == 6);
  }
  auto counts = CountParams(*inv);
  REQUIRE_OK(counts);
  CHECK(counts->params_total == 6 * dtypes.size());
  CHECK(counts->bytes_as_stored == bytes);
}

TEST_CASE("source: safetensors reads a header with 50k tensors") {
  // Large MoE checkpoints list tens of thousands of tensors. A parser quadratic in the keys of one
  // object (nlohmann::ordered_json's own) takes tens of seconds here. A sanitizer build, which
  // checks the memory and not the time, reads a tenth: 29 s of scripts/test.sh's AddressSanitizer
  // run was this case (Note [CI time] there).
  const int n = memplan::testing::kSanitizerBuild ? 5000 : 50000;
  TempDir dir(kTempPrefix);
  std::vector<Spec> specs;
  for (int i = 0; i < n; ++i) {
    specs.push_back({"model.layers." + std::to_string(i / 256) + ".mlp.experts." +
                         std::to_string(i % 256) + ".w",
                     "BF16",
                     {2}});
  }
  const std::string path = dir.PathOf("moe.safetensors");
  WriteSafetensors(path, specs);
  auto inv = InventoryFromSafetensorsFile(path);
  INFO(inv.status().ToString());
  REQUIRE_OK(inv);
  REQUIRE(inv->tensors.size() == static_cast<size_t>(n));
  CHECK(inv->tensors.back().name == "model.layers." + std::to_string((n - 1) / 256) +
                                        ".mlp.experts." + std::to_string((n - 1) % 256) + ".w");
  if (n == 50000) CHECK(inv->tensors[49999].name == "model.layers.195.mlp.experts.79.w");
  auto counts = CountParams(*inv);
  REQUIRE_OK(counts);
  CHECK(counts->params_total == 2 * static_cast<uint64_t>(n));
  CHECK(counts->num_blocks == static_cast<uint64_t>((n + 255) / 256));
}

TEST_CASE("source: safetensors refuses a lying length prefix without allocating it") {
  TempDir dir(kTempPrefix);
  const std::string path = dir.PathOf("bad.safetensors");
  const std::string header = R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})";

  WriteRaw(path, header, 4, 1000);
  CHECK(FileError(path) == path + ": header length 1000 is larger than the file (" +
                               std::to_string(8 + header.size() + 4) +
                               " bytes); not a safetensors file, or truncated");

  WriteRaw(path, header, 4, uint64_t{1} << 63);
  CHECK(StartsWith(FileError(path), path + ": header length 9223372036854775808 is larger"));

  // A file big enough to hold the claimed header, whose claim is still over the cap. Sparse, so
  // it costs no disk.
  const uint64_t over_cap = (uint64_t{100} << 20) + 1;
  WriteRaw(path, header, 4, over_cap);
  REQUIRE(::truncate(path.c_str(), static_cast<off_t>(over_cap + 64)) == 0);
  CHECK(FileError(path) == path +
                               ": header length 104857601 exceeds the 104857600-byte limit; "
                               "not a safetensors file");

  WriteBytes(path, std::string("\x05\x00\x00", 3));
  CHECK(FileError(path) == path + ": file is 3 bytes, too short for a safetensors header");
  WriteBytes(path, "");
  CHECK(StartsWith(FileError(path), path + ": file is 0 bytes"));

  auto missing = InventoryFromSafetensorsFile(dir.PathOf("absent.safetensors"));
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == StatusCode::kNotFound);
  CHECK(missing.status().message().find("absent.safetensors") != std::string::npos);
}

TEST_CASE("source: safetensors refuses offsets that lie, naming file and tensor") {
  TempDir dir(kTempPrefix);
  const std::string path = dir.PathOf("lie.safetensors");
  auto error_for = [&](const std::string& header, uint64_t data_bytes) {
    WriteRaw(path, header, data_bytes);
    return FileError(path);
  };
  const std::string prefix = path + ": tensor 'w': ";

  // Truncated data section: the header promises 64 bytes, the file holds 10.
  CHECK(error_for(R"({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}})", 10) ==
        prefix +
            "data_offsets [0, 64] lie outside the data section, which holds 10 bytes "
            "(truncated file?)");
  CHECK(error_for(R"({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}})", 64) ==
        prefix + "data_offsets [0, 60] span 60 bytes, but shape [4, 4] of F32 needs 64");
  CHECK(error_for(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 64) ==
        prefix + "data_offsets [8, 4] end before they begin");
  CHECK(error_for(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", 64)
            .find(prefix + "\"data_offsets\" must be [begin, end]") == 0);
  CHECK(error_for(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}})", 64)
            .find(prefix + "\"data_offsets\" must be") == 0);
  CHECK(error_for(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4]}})", 64)
            .find(prefix + "\"data_offsets\" must be") == 0);
  CHECK(error_for(R"({"w": {"dtype": "F32", "shape": [1]}})", 64)
            .find(prefix + "\"data_offsets\" must be [begin, end] with non-negative integers, "
                           "got nothing") == 0);
  // Offsets near 2^64 must not wrap around the bounds check.
  CHECK(error_for(R"({"w": {"dtype": "U8", "shape": [4],)"
                  R"( "data_offsets": [18446744073709551612, 18446744073709551615]}})",
                  64)
            .find(prefix +
                  "data_offsets [18446744073709551612, 18446744073709551615] lie outside") == 0);
  CHECK(error_for(R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 8],)"
                  R"( "data_offsets": [0, 4]}})",
                  64) == path +
                             ": tensor 'w': shape [4611686018427387904, 8] has more bytes than "
                             "fit in 64 bits");
  CHECK(error_for(R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 64) ==
        prefix + "shape dim 0 is -1, must be a non-negative integer");
  CHECK(error_for(R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", 64) ==
        prefix + "shape dim 0 is 1.5, must be a non-negative integer");
  CHECK(error_for(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
                  R"( "w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                  64) == prefix + "data_offsets [8, 16] overlap those of tensor 'a' [0, 16]");
}

TEST_CASE("source: a header-only safetensors file (8 + N bytes, as a range request returns)") {
  TempDir dir(kTempPrefix);
  const std::string path = dir.PathOf("model.safetensors.header");
  const std::string header = R"({"a": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]},)"
                             R"( "b": {"dtype": "F32", "shape": [3], "data_offsets": [64, 76]}})";
  WriteRaw(path, header, 0);
  auto inv = InventoryFromSafetensorsFile(path);
  REQUIRE_MESSAGE(inv.ok(), inv.status().ToString());
  CHECK(Names(*inv) == std::vector<std::string>{"a", "b"});
  CHECK(inv->tensors[0].numel == 32);
  // Without data the offsets are still checked against the shapes and each other.
  WriteRaw(path, R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}})", 0);
  CHECK(FileError(path) == path +
                               ": tensor 'w': data_offsets [0, 12] span 12 bytes, but shape [4] "
                               "of F32 needs 16");
  // Some data but not all of it is a truncated file, as before.
  WriteRaw(path, header, 10);
  CHECK(FileError(path).find("lie outside the data section, which holds 10 bytes") !=
        std::string::npos);
}

TEST_CASE("source: safetensors refuses malformed headers, naming file and tensor") {
  TempDir dir(kTempPrefix);
  const std::string path = dir.PathOf("bad.safetensors");
  auto error_for = [&](const std::string& header) {
    WriteRaw(path, header, 16);
    return FileError(path);
  };
  CHECK(error_for(R"({"w": {"dtype": "U32", "shape": [4], "data_offsets": [0, 16]}})") ==
        path +
            ": tensor 'w': unsupported dtype \"U32\" (memplan reads F64 F32 F16 BF16 F8_E4M3 "
            "F8_E5M2 I64 I32 I16 I8 U8 BOOL)");
  // Safetensors spells dtypes one way; PyTorch names are not safetensors.
  CHECK(
      StartsWith(error_for(R"({"w": {"dtype": "float32", "shape": [4], "data_offsets": [0, 16]}})"),
                 path + ": tensor 'w': unsupported dtype \"float32\""));
  CHECK(error_for(R"({"w": {"shape": [4], "data_offsets": [0, 16]}})") ==
        path + ": tensor 'w': missing or non-string \"dtype\"");
  CHECK(error_for(R"({"w": {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}})") ==
        path + ": tensor 'w': missing or non-array \"shape\"");
  CHECK(error_for(R"({"w": [0, 16]})") ==
        path + ": tensor 'w': expected an object with dtype, shape and data_offsets, got [0,16]");
  CHECK(StartsWith(error_for(R"([1, 2])"), path + ": header must be a JSON object"));
  CHECK(StartsWith(error_for("not json at all"), path + ": invalid JSON"));
  CHECK(StartsWith(error_for(""), path + ": invalid JSON"));
  CHECK(StartsWith(error_for(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                             R"( "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})"),
                   path + ": key 'w' appears twice"));
  CHECK(StartsWith(error_for(R"({"": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})"),
                   path + ": tensor with an empty name"));
  CHECK(error_for(R"({"__metadata__": {"format": "pt"}})") == path + ": holds no tensors");

  // Nesting deep enough to hurt a recursive parser is refused before parsing.
  std::string deep = R"({"w": )" + std::string(200000, '[') + std::string(200000, ']') + "}";
  CHECK(StartsWith(error_for(deep), path + ": JSON nested 200001 levels deep (limit 16)"));

  // Names must be UTF-8, as the format requires.
  std::string err = error_for(
      "{\"bad\xff\xfe\": {\"dtype\": \"F32\", \"shape\": [1], "
      "\"data_offsets\": [0, 4]}}");
  CHECK(StartsWith(err, path + ": invalid JSON"));
  CHECK(err.find("UTF-8") != std::string::npos);
}

TEST_CASE("source: sharded safetensors index reads each shard and checks the weight map") {
  TempDir dir(kTempPrefix);
  WriteSafetensors(dir.PathOf("model-00001-of-00002.safetensors"),
                   {{"model.embed_tokens.weight", "BF16", {32, 8}},
                    {"model.layers.0.self_attn.q_proj.weight", "BF16", {8, 8}}});
  WriteSafetensors(dir.PathOf("model-00002-of-00002.safetensors"),
                   {{"model.layers.1.self_attn.q_proj.weight", "BF16", {8, 8}},
                    {"model.norm.weight", "F32", {8}},
                    {"lm_head.weight", "BF16", {32, 8}}});
  const std::string index = dir.PathOf("model.safetensors.index.json");
  WriteBytes(index, R"({
    "metadata": {"total_size": 1184},
    "weight_map": {
      "lm_head.weight": "model-00002-of-00002.safetensors",
      "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
      "model.layers.0.self_attn.q_proj.weight": "model-00001-of-00002.safetensors",
      "model.layers.1.self_attn.q_proj.weight": "model-00002-of-00002.safetensors",
      "model.norm.weight": "model-00002-of-00002.safetensors"
    }
  })");
  auto inv = InventoryFromSafetensorsIndex(index);
  INFO(inv.status().ToString());
  REQUIRE_OK(inv);
  CHECK(inv->source == "safetensors");
  CHECK(inv->name == index);
  CHECK(Names(*inv) == std::vector<std::string>{"model.embed_tokens.weight",
                                                "model.layers.0.self_attn.q_proj.weight",
                                                "model.layers.1.self_attn.q_proj.weight",
                                                "model.norm.weight", "lm_head.weight"});
  CHECK(inv->tensors[3].dtype == DType::kF32);
  CHECK(inv->tensors[4].shape == std::vector<int64_t>{32, 8});
  auto counts = CountParams(*inv);
  REQUIRE_OK(counts);
  CHECK(counts->params_total == 256 + 64 + 64 + 8 + 256);
  CHECK(counts->num_blocks == 2);
  CHECK(counts->bytes_as_stored == 2 * (256 + 64 + 64 + 256) + 4 * 8);
}

TEST_CASE("source: sharded safetensors follows symlinks and subdirectories inside the index dir") {
  // The Hugging Face cache stores shards as symlinks to ../../blobs/<sha>.
  TempDir dir(kTempPrefix);
  fs::create_directories(dir.PathOf("blobs"));
  fs::create_directories(dir.PathOf("snap/sub"));
  WriteSafetensors(dir.PathOf("blobs/abc123"), {{"a.weight", "F16", {4, 4}}});
  fs::create_symlink("../blobs/abc123", dir.PathOf("snap/model-1.safetensors"));
  WriteSafetensors(dir.PathOf("snap/sub/model-2.safetensors"), {{"b.weight", "F16", {2}}});
  WriteBytes(dir.PathOf("snap/index.json"), R"({"weight_map": {"a.weight": "model-1.safetensors",)"
                                            R"( "b.weight": "sub/model-2.safetensors"}})");
  auto inv = InventoryFromSafetensorsIndex(dir.PathOf("snap/index.json"));
  INFO(inv.status().ToString());
  REQUIRE_OK(inv);
  CHECK(Names(*inv) == std::vector<std::string>{"a.weight", "b.weight"});
}

TEST_CASE("source: sharded safetensors refuses escaping paths and a map that lies") {
  TempDir dir(kTempPrefix);
  WriteSafetensors(dir.PathOf("s1.safetensors"), {{"a", "F32", {2}}, {"b", "F32", {2}}});
  WriteSafetensors(dir.PathOf("s2.safetensors"), {{"c", "F32", {2}}, {"b", "F32", {2}}});
  const std::string index = dir.PathOf("model.safetensors.index.json");
  auto error_for = [&](const std::string& text) {
    WriteBytes(index, text);
    return IndexError(index);
  };
  CHECK(error_for(R"({"weight_map": {"a": "../s1.safetensors"}})") ==
        index +
            ": weight_map: tensor 'a': shard path '../s1.safetensors' leaves its directory "
            "('..')");
  CHECK(error_for(R"({"weight_map": {"a": "sub/../../s1.safetensors"}})").find("leaves its") !=
        std::string::npos);
  CHECK(error_for(R"({"weight_map": {"a": "/etc/passwd"}})") ==
        index + ": weight_map: tensor 'a': shard path '/etc/passwd' is absolute");
  // Note [Paths from data]'s other refusals, the same for a local index as for the Hub's.
  CHECK(error_for(R"({"weight_map": {"a": "sub\\s1.safetensors"}})").find("backslash") !=
        std::string::npos);
  CHECK(error_for(R"({"weight_map": {"a": "./s1.safetensors"}})").find("'.' component") !=
        std::string::npos);
  CHECK(error_for(R"({"weight_map": {"a": "s1.safetensors\n"}})").find("control character") !=
        std::string::npos);
  CHECK(error_for(R"({"weight_map": {"a": ""}})").find("is empty") != std::string::npos);
  CHECK(error_for(R"({"weight_map": {"a": 5}})") ==
        index + ": weight_map: tensor 'a': shard must be a file name, got 5");
  CHECK(error_for(R"({"weight_map": {}})") == index + ": field 'weight_map': names no tensors");
  CHECK(StartsWith(error_for(R"({"metadata": {}})"), index + ": field 'weight_map': missing"));
  CHECK(StartsWith(error_for("[]"), index + ": expected a JSON object"));

  // The map says 'c' is in s1; it is in s2.
  CHECK(error_for(R"({"weight_map": {"a": "s1.safetensors", "c": "s1.safetensors"}})") ==
        index + ": weight_map puts tensor 'c' in 's1.safetensors', but " +
            dir.PathOf("s1.safetensors") + " has no tensor of that name");
  CHECK(error_for(R"({"weight_map": {"a": "s1.safetensors", "c": "s1.safetensors",)"
                  R"( "x": "s2.safetensors"}})") ==
        index + ": tensor 'b' is in both 's1.safetensors' and 's2.safetensors'");

  std::string missing = error_for(R"({"weight_map": {"a": "s9.safetensors"}})");
  CHECK(StartsWith(missing, index + ": shard 's9.safetensors': " + dir.PathOf("s9.safetensors")));

  // A hostile shard is reported with both the index and the shard's own path.
  WriteRaw(dir.PathOf("s3.safetensors"),
           R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 4]}})", 4);
  CHECK(error_for(R"({"weight_map": {"w": "s3.safetensors"}})") ==
        index + ": shard 's3.safetensors': " + dir.PathOf("s3.safetensors") +
            ": tensor 'w': data_offsets [0, 4] span 4 bytes, but shape [4] of F32 needs 16");

  std::string deep = R"({"weight_map": )" + std::string(1000, '[') + std::string(1000, ']') + "}";
  CHECK(StartsWith(error_for(deep), index + ": JSON nested 1001 levels deep (limit 16)"));
}

TEST_CASE("source: sharded safetensors keeps tensors a shard holds beyond the map") {
  TempDir dir(kTempPrefix);
  WriteSafetensors(dir.PathOf("s1.safetensors"), {{"a", "F32", {2}}, {"extra", "F32", {3}}});
  const std::string index = dir.PathOf("index.json");
  WriteBytes(index, R"({"weight_map": {"a": "s1.safetensors"}})");
  auto inv = InventoryFromSafetensorsIndex(index);
  REQUIRE_OK(inv);
  CHECK(Names(*inv) == std::vector<std::string>{"a", "extra"});
}

}  // namespace
}  // namespace memplan::estimator
