#include "estimator/model_source.h"

#include <sys/stat.h>

#include "common/file.h"
#include "common/json.h"
#include "estimator/builtin_models.h"
#include "estimator/hf_cache.h"
#include "estimator/safetensors.h"
#include "estimator/shape_list.h"

namespace memplan::estimator {
namespace {

// Configs are a few KiB and shape lists of the largest models a few MiB; anything bigger is not
// one of them, and reading it whole would only waste memory.
constexpr uint64_t kMaxJsonBytes = uint64_t{32} << 20;
constexpr int kMaxJsonDepth = 64;

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

enum class PathKind { kMissing, kFile, kDirectory };

PathKind Stat(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return PathKind::kMissing;
  return S_ISDIR(st.st_mode) ? PathKind::kDirectory : PathKind::kFile;
}

Result<ModelInventory> LoadJsonFile(const std::string& path, const BuildOptions& options) {
  MEMPLAN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path, kMaxJsonBytes));
  // One ordered parse serves both readers: shape lists keep the document's tensor order.
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::ordered_json doc,
                           ParseOrderedJsonText(text, path, kMaxJsonDepth));
  if (LooksLikeShapeList(doc)) return InventoryFromShapeList(doc, path);
  return InventoryFromHfConfig(nlohmann::json(doc), path, options);
}

Result<ModelInventory> LoadFile(const std::string& path, const BuildOptions& options) {
  if (EndsWith(path, ".safetensors")) return InventoryFromSafetensorsFile(path);
  if (EndsWith(path, ".safetensors.index.json")) return InventoryFromSafetensorsIndex(path);
  return LoadJsonFile(path, options);
}

Result<ModelInventory> LoadDirectory(const std::string& dir, const BuildOptions& options) {
  for (const char* name : {"config.json", "model.safetensors.index.json", "model.safetensors"}) {
    std::string path = dir + "/" + name;
    if (Stat(path) == PathKind::kFile) return LoadFile(path, options);
  }
  return Status::NotFound(dir +
                          ": directory has no config.json, model.safetensors.index.json or "
                          "model.safetensors");
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

}  // namespace

Result<ModelInventory> LoadModel(const std::string& spec, ModelClassChoice choice) {
  return LoadModel(spec, BuildOptions{choice});
}

Result<ModelInventory> LoadModel(const std::string& spec, const BuildOptions& options) {
  if (spec.empty()) return Status::InvalidArgument("--model is empty");
  Result<ModelInventory> result = Status::Internal("unresolved");
  const BuiltinModel* builtin = FindBuiltinModel(spec);
  const BuiltinModel* published = FindBuiltinModelByHubId(spec);
  PathKind kind = Stat(spec);
  if (kind == PathKind::kFile) {
    result = LoadFile(spec, options);
  } else if (kind == PathKind::kDirectory) {
    result = LoadDirectory(spec, options);
  } else if (builtin != nullptr) {
    result = LoadBuiltin(*builtin, options);
  } else if (LooksLikeRepoId(spec)) {
    Result<std::string> snapshot = FindHfCacheSnapshot(spec);
    if (snapshot.ok()) {
      result = LoadDirectory(*snapshot, options);
    } else if (published != nullptr) {
      result = LoadBuiltin(*published, options);  // not in the local cache, but built in
    } else {
      return Status::NotFound("model '" + spec +
                              "': not a file or directory, not a built-in model (see `memplan "
                              "models`), and " + snapshot.status().message());
    }
  } else {
    return Status::NotFound("model '" + spec +
                            "': not a file or directory, and not a built-in model (see "
                            "`memplan models`); a Hugging Face repo id looks like org/name");
  }
  if (!result.ok()) return result;
  result->name = spec;
  return result;
}

}  // namespace memplan::estimator
