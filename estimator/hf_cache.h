// Finds a model in the local Hugging Face hub cache, offline: never touches the network.
//
// Cache root, in Transformers' order: $HF_HUB_CACHE (or its older name $HUGGINGFACE_HUB_CACHE),
// else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub; empty
// variables count as unset. $TRANSFORMERS_CACHE, deprecated but still honoured by Transformers,
// is searched after it. A repo "org/name" lives in <root>/models--org--name/snapshots/<revision>/;
// the revision is the commit hash refs/main holds when that snapshot exists, else the most
// recently modified snapshot.
//
// Thread safety: reads the environment and the file system only; safe from any thread that does
// not change the environment concurrently.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace memplan::estimator {

// The cache roots searched, in order, for the current environment (for messages and tests).
std::vector<std::string> HfCacheRoots();

// Snapshot directory of `repo_id` ("org/name" or "name", validated as huggingface_hub does, so
// "..", "--", absolute paths and extra '/' are InvalidArgument and never touch the disk).
// The Hub's ids are case-insensitive, so when models--org--name is not there a folder whose name
// matches it ignoring case is taken. NotFound lists the directories searched.
Result<std::string> FindHfCacheSnapshot(std::string_view repo_id);

// InvalidArgument unless `repo_id` is a valid Hugging Face repo id (see FindHfCacheSnapshot).
Status ValidateRepoId(std::string_view repo_id);

// True when `dir` is a repository folder of the cache (models--org--name with snapshots/), and
// then the snapshot it resolves to, as for FindHfCacheSnapshot: refs/main, else the newest.
bool IsHfCacheRepoFolder(const std::string& dir);
Result<std::string> SnapshotOfRepoFolder(const std::string& dir);

}  // namespace memplan::estimator
