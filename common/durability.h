// What a commit survives: the swap store's Sync(), the optimizer's per-step commit, an atomic file
// write (Note [Durability levels] in common/file.cc).
#pragma once

namespace memplan {

enum class Durability {
  kPowerLoss,     // flushed (files fsynced, then their directories; a store's data file
                  // fdatasynced): survives a power loss or a kernel crash
  kProcessCrash,  // written and renamed without any fsync or flush: survives the process being
                  // killed (the kernel holds the bytes), not a power loss or a kernel crash
};

}  // namespace memplan
