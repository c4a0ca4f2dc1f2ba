#include "estimator/hf_cache.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <optional>
#include <system_error>

#include "common/file.h"
#include "common/strings.h"

namespace memplan::estimator {
namespace {

namespace fs = std::filesystem;

bool IsWordChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

}  // namespace

// huggingface_hub's validate_repo_id, ASCII only: one or two parts of [\w.-] that begin and end
// with a word character, no "--" or "..", at most 96 characters. This is also what keeps a repo
// id from naming a path outside the cache.
Status ValidateRepoId(std::string_view repo_id) {
  auto refuse = [&](std::string_view why) {
    return Status::InvalidArgument(
        "'" + std::string(repo_id) +
        "' is not a Hugging Face repo id (expected \"org/name\"): " + std::string(why));
  };
  if (repo_id.empty()) return refuse("it is empty");
  if (repo_id.size() > 96) return refuse("longer than 96 characters");
  if (repo_id.find("..") != std::string_view::npos) return refuse("contains \"..\"");
  if (repo_id.find("--") != std::string_view::npos) return refuse("contains \"--\"");
  size_t slash = repo_id.find('/');
  if (slash != std::string_view::npos && repo_id.find('/', slash + 1) != std::string_view::npos) {
    return refuse("more than one '/'");
  }
  std::vector<std::string_view> parts = {repo_id};
  if (slash != std::string_view::npos) {
    parts = {repo_id.substr(0, slash), repo_id.substr(slash + 1)};
  }
  for (std::string_view part : parts) {
    if (part.empty()) return refuse("an empty part (a path is not a repo id)");
    for (char c : part) {
      if (!IsWordChar(c) && c != '-' && c != '.') {
        return refuse(std::string("character '") + c + "' is not allowed");
      }
    }
    if (!IsWordChar(part.front()) || !IsWordChar(part.back())) {
      return refuse("each part must begin and end with a letter, digit or '_'");
    }
  }
  return Status::Ok();
}

namespace {

// A commit hash: refs/main is a file anyone can write, so its content must not become a path
// (no '/', no '.').
bool IsRevisionName(std::string_view s) {
  if (s.empty() || s.size() > 128) return false;
  for (char c : s) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

bool IsDirectory(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}

// The revision refs/main names, when its snapshot exists.
std::optional<fs::path> SnapshotFromRef(const fs::path& repo_dir) {
  auto ref = ReadFileToString((repo_dir / "refs" / "main").string(), 4096);
  if (!ref.ok()) return std::nullopt;
  std::string hash = *ref;
  while (!hash.empty() && (hash.back() == '\n' || hash.back() == '\r' || hash.back() == ' ' ||
                           hash.back() == '\t')) {
    hash.pop_back();
  }
  if (!IsRevisionName(hash)) return std::nullopt;
  fs::path snapshot = repo_dir / "snapshots" / hash;
  if (!IsDirectory(snapshot)) return std::nullopt;
  return snapshot;
}

// The most recently modified snapshot; ties go to the greatest name so the choice is stable.
std::optional<fs::path> NewestSnapshot(const fs::path& repo_dir) {
  std::error_code ec;
  fs::directory_iterator it(repo_dir / "snapshots", ec);
  if (ec) return std::nullopt;
  std::optional<fs::path> best;
  fs::file_time_type best_time;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) break;
    const fs::path& p = it->path();
    std::string name = p.filename().string();
    if (name.empty() || name[0] == '.' || !IsDirectory(p)) continue;
    std::error_code time_ec;
    fs::file_time_type t = fs::last_write_time(p, time_ec);
    if (time_ec) continue;
    if (!best || t > best_time || (t == best_time && name > best->filename().string())) {
      best = p;
      best_time = t;
    }
  }
  return best;
}

// `root`/`folder`, or the entry of `root` equal to it ignoring case (the Hub's ids are
// case-insensitive, and users type them as they remember them).
std::optional<fs::path> RepoFolderIn(const std::string& root, const std::string& folder) {
  fs::path exact = fs::path(root) / folder;
  if (IsDirectory(exact)) return exact;
  std::error_code ec;
  fs::directory_iterator it(root, ec);
  if (ec) return std::nullopt;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) break;
    if (EqualsIgnoreCase(it->path().filename().string(), folder) && IsDirectory(it->path())) {
      return it->path();
    }
  }
  return std::nullopt;
}

}  // namespace

bool IsHfCacheRepoFolder(const std::string& dir) {
  // "hub/models--org--name/" names the folder as well as "hub/models--org--name".
  fs::path path = fs::path(dir).lexically_normal();
  if (path.filename().empty()) path = path.parent_path();
  return path.filename().string().rfind("models--", 0) == 0 && IsDirectory(path / "snapshots");
}

Result<std::string> SnapshotOfRepoFolder(const std::string& dir) {
  try {
    if (auto snapshot = SnapshotFromRef(dir)) return snapshot->string();
    if (auto snapshot = NewestSnapshot(dir)) return snapshot->string();
    return Status::NotFound(dir + ": a Hugging Face cache folder with no snapshots");
  } catch (const std::exception& e) {
    return Status::Internal(dir + ": reading the cache folder failed: " + e.what());
  }
}

std::vector<std::string> HfCacheRoots() {
  std::vector<std::string> roots;
  std::string root = EnvOrEmpty("HF_HUB_CACHE");
  if (root.empty()) root = EnvOrEmpty("HUGGINGFACE_HUB_CACHE");  // huggingface_hub's older name
  if (root.empty() && !EnvOrEmpty("HF_HOME").empty()) root = EnvOrEmpty("HF_HOME") + "/hub";
  if (root.empty() && !EnvOrEmpty("XDG_CACHE_HOME").empty()) {
    root = EnvOrEmpty("XDG_CACHE_HOME") + "/huggingface/hub";
  }
  if (root.empty() && !EnvOrEmpty("HOME").empty())
    root = EnvOrEmpty("HOME") + "/.cache/huggingface/hub";
  if (!root.empty()) roots.push_back(root);
  // Transformers still honours its deprecated variable; models downloaded under it are in the
  // same layout, so look there too.
  std::string legacy = EnvOrEmpty("TRANSFORMERS_CACHE");
  if (!legacy.empty() && legacy != root) roots.push_back(legacy);
  return roots;
}

Result<std::string> FindHfCacheSnapshot(std::string_view repo_id) {
  MEMPLAN_RETURN_IF_ERROR(ValidateRepoId(repo_id));
  try {
    std::string folder = "models--";
    for (char c : repo_id) {
      if (c == '/') {
        folder += "--";
      } else {
        folder += c;
      }
    }
    std::vector<std::string> roots = HfCacheRoots();
    std::string searched;
    for (const std::string& root : roots) {
      searched += (searched.empty() ? "" : ", ") + (fs::path(root) / folder).string();
      std::optional<fs::path> repo_dir = RepoFolderIn(root, folder);
      if (!repo_dir) continue;
      if (auto snapshot = SnapshotFromRef(*repo_dir)) return snapshot->string();
      if (auto snapshot = NewestSnapshot(*repo_dir)) return snapshot->string();
      searched += " (no snapshots)";
    }
    if (roots.empty()) {
      searched = "none: HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME and HOME are all unset";
    }
    return Status::NotFound("model '" + std::string(repo_id) +
                            "' is not in the local Hugging Face cache (searched " + searched + ")");
  } catch (const std::exception& e) {
    return Status::Internal("looking up '" + std::string(repo_id) +
                            "' in the Hugging Face cache failed: " + e.what());
  }
}

}  // namespace memplan::estimator
