// A picture of `memplan plan`'s answer (`memplan plan --svg FILE`): the top plans side by side,
// each with its peak memory per tier (GPU per GPU; CPU, pinned and NVMe per node) drawn against
// the tier's capacity and usable limit (Note [Feasibility] in search.h), and its predicted step
// time as a stacked bar of compute, exposed communication, exposed offload transfers (PCIe and
// NVMe) and the optimizer phase (Note [Step-time model]), all plans on one time scale. When
// nothing fits, the picture says so and lists the first few rejected families with their reasons.
//
// The document is standalone SVG 1.1: no scripts, style sheets, fonts or images from elsewhere,
// generic font families only, and every piece of user text (model names, paths) XML-escaped with
// invalid UTF-8 and control characters replaced, so any input gives a well-formed document. The
// output is a pure function of the inputs with every number printed at fixed precision, so the
// same plans give a byte-identical file.
//
// Thread safety: a pure function over plain values.
#pragma once

#include <cstddef>
#include <string>

#include "planner/capacity.h"
#include "planner/cluster.h"
#include "planner/job.h"
#include "planner/search.h"

namespace memplan::planner {

// The SVG document for the first `top` plans of `result` (all of them when fewer fit; `top` 0
// counts as 1). `options` are the search's, for the usable limits drawn beside the capacities; a
// tier whose capacity is unknown (0) is drawn as "no capacity given". Never fails.
std::string PlansSvg(const PlanResult& result, const Cluster& cluster, const Job& job, size_t top,
                     const SearchOptions& options = {});

// `memplan capacity --svg FILE`: cost (GPU-hours when no price is given) against time to train,
// both on log scales, one point per GPU type x count that fits (colour per type, labelled with
// the count), the fewest-GPUs, fastest and cheapest answers ringed and named. The same
// guarantees as PlansSvg (standalone, escaped, deterministic). Never fails.
std::string CapacitySvg(const CapacityResult& result, const CapacityRequest& request,
                        const Job& job);

}  // namespace memplan::planner
