// Test seams of common/file.cc; not part of the installed API.
#pragma once

#include <string>

namespace memplan::internal {

// Called by AtomicFileGroup::Commit just before it renames each staged file over `path` (with the
// signals held); nullptr (the default) for none. Lets a test make a rename fail part way through
// a group.
void SetBeforeRenameHookForTesting(void (*hook)(const std::string& path));

}  // namespace memplan::internal
