#include "estimator/model_source.h"

#include <sys/stat.h>

#include <set>
#include <vector>

#include "common/strings.h"
#include "common/file.h"
#include "common/json.h"
#include "common/printable.h"
#include "common/suggest.h"
#include "estimator/builtin_models.h"
#include "estimator/hf_cache.h"
#include "estimator/safetensors.h"
#include "estimator/shape_list.h"

namespace memplan::estimator {
namespace {

// Configs are a few KiB and shape lists of the largest models a few MiB; anything bigger is not
// one of them, and reading it whole would only waste memory.
constexpr uint64_t kMaxJsonBytes = uint64_t{32} << 20;
constexpr int kMaxConfigJsonDepth = 64;

constexpr const char* kIndex = "model.safetensors.index.json";
constexpr const char* kSingle = "model.safetensors";

enum class PathKind { kMissing, kFile, kDirectory };

PathKind Stat(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return PathKind::kMissing;
  return S_ISDIR(st.st_mode) ? PathKind::kDirectory : PathKind::kFile;
}

Result<nlohmann::ordered_json> ReadJson(const std::string& path) {
  MEMPLAN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path, kMaxJsonBytes));
  return ParseOrderedJsonText(text, path, kMaxConfigJsonDepth, kMaxShapeListTensors);
}

Result<ModelInventory> LoadJsonFile(const std::string& path, const BuildOptions& options) {
  // One ordered parse serves both readers: shape lists keep the document's tensor order.
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::ordered_json doc, ReadJson(path));
  if (LooksLikeShapeList(doc)) return InventoryFromShapeList(doc, path);
  return InventoryFromHfConfig(nlohmann::json(doc), path, options);
}

Result<ModelInventory> LoadFile(const std::string& path, const BuildOptions& options) {
  if (EndsWith(path, ".safetensors") || EndsWith(path, ".safetensors.header")) {
    return InventoryFromSafetensorsFile(path);
  }
  if (EndsWith(path, ".safetensors.index.json")) return InventoryFromSafetensorsIndex(path);
  return LoadJsonFile(path, options);
}

// The shards a safetensors index names that are in `dir` neither whole nor as a header. Every
// name is checked (Note [Paths from data], the rule InventoryFromSafetensorsIndex applies) before
// any is looked for or fetched: a name from the Hub becomes a path in the cache.
Result<std::vector<std::string>> MissingShards(const std::string& dir) {
  const std::string index_path = dir + "/" + kIndex;
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::ordered_json index, ReadJson(index_path));
  std::set<std::string> shards;
  if (index.is_object() && index.contains("weight_map") && index["weight_map"].is_object()) {
    for (const auto& [tensor, shard] : index["weight_map"].items()) {
      if (!shard.is_string()) continue;  // the index reader says what is wrong with it
      MEMPLAN_RETURN_IF_ERROR(CheckRelativePath(
          shard.get<std::string>(),
          index_path + ": weight_map: tensor '" + Printable(tensor) + "': shard path"));
      shards.insert(shard.get<std::string>());
    }
  }
  std::vector<std::string> missing;
  for (const std::string& shard : shards) {
    if (Stat(dir + "/" + shard) == PathKind::kMissing &&
        Stat(dir + "/" + shard + ".header") == PathKind::kMissing) {
      missing.push_back(shard);
    }
  }
  return missing;
}

// The tensors of the safetensors in `dir` (an index with its shards, or one file, whole or
// their headers), fetching what is missing when `repo_id` names a Hub repo and the options allow
// it. Fetched files may land in a newer snapshot than `dir`: `dir` follows them.
Result<ModelInventory> LoadWeights(std::string dir, const std::string& repo_id,
                                   const LoadOptions& options) {
  const bool fetch = !repo_id.empty() && options.hub.allow_network;
  if (fetch && Stat(dir + "/" + kIndex) == PathKind::kMissing &&
      Stat(dir + "/" + kSingle) == PathKind::kMissing &&
      Stat(dir + "/" + kSingle + ".header") == PathKind::kMissing) {
    Result<std::string> index = FetchHubFile(repo_id, kIndex, options.hub);
    if (index.ok()) {
      dir = *index;
    } else if (index.status().code() == StatusCode::kNotFound) {
      MEMPLAN_ASSIGN_OR_RETURN(dir, FetchHubSafetensorsHeader(repo_id, kSingle, options.hub));
    } else {
      return index.status();
    }
  }
  if (Stat(dir + "/" + kIndex) == PathKind::kFile) {
    if (fetch) {
      MEMPLAN_ASSIGN_OR_RETURN(std::vector<std::string> missing, MissingShards(dir));
      for (const std::string& shard : missing) {
        MEMPLAN_RETURN_IF_ERROR(FetchHubSafetensorsHeader(repo_id, shard, options.hub).status());
      }
    }
    return InventoryFromSafetensorsIndex(dir + "/" + kIndex);
  }
  for (const std::string& name : {std::string(kSingle), std::string(kSingle) + ".header"}) {
    if (Stat(dir + "/" + name) == PathKind::kFile) {
      return InventoryFromSafetensorsFile(dir + "/" + name);
    }
  }
  return Status::NotFound(dir + " has no " + kIndex + " or " + kSingle);
}

// `dir`: a model directory (a Hub snapshot included), or a cache folder models--org--name.
Result<ModelInventory> LoadDirectory(std::string dir, const std::string& repo_id,
                                     const LoadOptions& options) {
  if (IsHfCacheRepoFolder(dir)) {
    MEMPLAN_ASSIGN_OR_RETURN(dir, SnapshotOfRepoFolder(dir));
  }
  const std::string config = dir + "/config.json";
  if (Stat(config) == PathKind::kFile) {
    Result<ModelInventory> built = LoadFile(config, options.build);
    if (built.ok() || built.status().code() != StatusCode::kUnimplemented) return built;
    // A model_type memplan does not build: the safetensors headers still give every tensor.
    Result<ModelInventory> weights = LoadWeights(dir, repo_id, options);
    if (!weights.ok()) {
      return Status::Unimplemented(built.status().message() +
                                   "; and no safetensors headers to fall back on (" +
                                   weights.status().message() + ")");
    }
    weights->notes.push_back(config +
                             ": its model_type is not one memplan builds, so the "
                             "tensors come from the safetensors headers (" +
                             weights->name + ")");
    Result<nlohmann::ordered_json> doc = ReadJson(config);
    Status attached =
        doc.ok() ? AttachArchitecture(nlohmann::json(*doc), config, &*weights) : doc.status();
    if (!attached.ok()) {
      weights->notes.push_back("no architecture for activations: " + attached.message());
    }
    return weights;
  }
  if (Stat(dir + "/" + kIndex) == PathKind::kFile || Stat(dir + "/" + kSingle) == PathKind::kFile ||
      Stat(dir + "/" + kSingle + ".header") == PathKind::kFile) {
    return LoadWeights(dir, repo_id, options);
  }
  return Status::NotFound(dir + ": directory has no config.json, " + kIndex + " or " + kSingle);
}

Result<ModelInventory> LoadBuiltin(const BuiltinModel& model, const BuildOptions& options) {
  MEMPLAN_ASSIGN_OR_RETURN(
      ModelInventory inventory,
      InventoryFromHfConfigText(model.config_json, std::string(model.name) + " (built-in)",
                                options));
  inventory.source = "builtin";
  return inventory;
}

bool LooksLikeRepoId(std::string_view spec) {
  size_t slash = spec.find('/');
  return slash != std::string_view::npos && slash > 0 && slash + 1 < spec.size() &&
         spec.find('/', slash + 1) == std::string_view::npos && spec[0] != '.';
}

std::vector<std::string> BuiltinNames() {
  std::vector<std::string> names;
  for (const BuiltinModel& m : BuiltinModels()) {
    names.emplace_back(m.name);
    if (!m.hub_id.empty()) names.emplace_back(m.hub_id);
  }
  return names;
}

Result<ModelInventory> LoadRepo(const std::string& repo_id, const LoadOptions& options) {
  Result<std::string> snapshot = FindHfCacheSnapshot(repo_id);
  if (snapshot.ok()) return LoadDirectory(*snapshot, repo_id, options);
  if (snapshot.status().code() != StatusCode::kNotFound) return snapshot.status();
  if (const BuiltinModel* published = FindBuiltinModelByHubId(repo_id)) {
    return LoadBuiltin(*published, options.build);  // not in the local cache, but built in
  }
  const std::string not_here = "model '" + repo_id +
                               "': not a file or directory, not a built-in model (see `memplan "
                               "models`), and " +
                               snapshot.status().message();
  if (!options.hub.allow_network) {
    return Status::NotFound(
        not_here + DidYouMean(ClosestMatches(repo_id, BuiltinNames())) +
        (options.hub.offline_reason.empty()
             ? "; download it (huggingface-cli download " + repo_id +
                   " config.json) or pass a local path"
             : "; fetching from the Hub is off (" + options.hub.offline_reason + ")"));
  }
  MEMPLAN_ASSIGN_OR_RETURN(std::string fetched, FetchHubFile(repo_id, "config.json", options.hub));
  return LoadDirectory(fetched, repo_id, options);
}

}  // namespace

Result<ModelInventory> LoadModel(const std::string& spec, ModelClassChoice choice) {
  return LoadModel(spec, BuildOptions{choice});
}

Result<ModelInventory> LoadModel(const std::string& spec, const BuildOptions& options) {
  LoadOptions load;
  load.build = options;
  return LoadModel(spec, load);
}

Result<ModelInventory> LoadModel(const std::string& spec, const LoadOptions& options) {
  if (spec.empty()) return Status::InvalidArgument("`model` is empty");
  Result<ModelInventory> result = Status::Internal("unresolved");
  PathKind kind = Stat(spec);
  if (kind == PathKind::kFile) {
    result = LoadFile(spec, options.build);
  } else if (kind == PathKind::kDirectory) {
    result = LoadDirectory(spec, "", options);
  } else if (const BuiltinModel* builtin = FindBuiltinModel(spec)) {
    result = LoadBuiltin(*builtin, options.build);
  } else if (LooksLikeRepoId(spec)) {
    result = LoadRepo(spec, options);
  } else {
    return Status::NotFound("model '" + spec + "': not a file or directory, and not a built-in " +
                            "model" + DidYouMean(ClosestMatches(spec, BuiltinNames())) +
                            " (see `memplan models`); a Hugging Face repo id looks like org/name");
  }
  if (!result.ok()) return result;
  result->name = spec;
  if (!options.model_config.empty()) {
    if (result->arch.has_value()) {
      result->notes.push_back("`model_config` " + options.model_config +
                              ": not used, the model's own config.json gives its architecture");
    } else {
      MEMPLAN_ASSIGN_OR_RETURN(nlohmann::ordered_json doc, ReadJson(options.model_config));
      MEMPLAN_RETURN_IF_ERROR(
          AttachArchitecture(nlohmann::json(doc), options.model_config, &*result));
    }
  }
  return result;
}

}  // namespace memplan::estimator
