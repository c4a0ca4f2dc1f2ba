// The C API's estimate, plan and capacity requests (memplan.h): JSON in, JSON out, through
// integration::requests. The engine half and what both share are c_api.cc's and
// c_api_internal.h's.
#include <nlohmann/json.hpp>

#include "common/json.h"
#include "common/status.h"
#include "integration/c_api_internal.h"
#include "integration/requests.h"
#include "memplan.h"

using memplan::Result;
using memplan::Status;
using memplan::capi::Dump;
using memplan::capi::GiveString;
using memplan::capi::Guard;
using memplan::capi::NullArgument;

namespace {

// A request function's body: the arguments checked (`*out` cleared before the request is read),
// `text` parsed as the `what`, answered, and the answer handed over as JSON text.
Status JsonRequest(const char* text, const char* what,
                   Result<nlohmann::json> (*answer)(const nlohmann::json&), char** out) {
  if (out == nullptr) return NullArgument("answer_json");
  *out = nullptr;
  if (text == nullptr) return NullArgument("request_json");
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json request, memplan::ParseJson(text, what));
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json result, answer(request));
  return GiveString(Dump(result), out);
}

}  // namespace

// ---- Estimate and plan --------------------------------------------------------------------------

MEMPLAN_C_EXPORT memplan_status memplan_estimate_json(const char* request_json,
                                                      char** answer_json) {
  return Guard(__func__, [&] {
    return JsonRequest(request_json, "estimate request", memplan::integration::Estimate,
                       answer_json);
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_estimate_path(const char* model, int64_t gpus_per_node,
                                                      int64_t nodes, char** answer_json) {
  return Guard(__func__, [&]() -> Status {
    if (answer_json == nullptr) return NullArgument("answer_json");
    *answer_json = nullptr;
    if (model == nullptr) return NullArgument("model");
    const nlohmann::json request = {{"model", model}, {"gpus", gpus_per_node}, {"nodes", nodes}};
    MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json answer, memplan::integration::Estimate(request));
    return GiveString(Dump(answer), answer_json);
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_plan_json(const char* request_json, char** answer_json) {
  return Guard(__func__, [&] {
    return JsonRequest(request_json, "plan request", memplan::integration::Plan, answer_json);
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_capacity_json(const char* request_json,
                                                      char** answer_json) {
  return Guard(__func__, [&] {
    return JsonRequest(request_json, "capacity request", memplan::integration::Capacity,
                       answer_json);
  });
}
