// The C API (memplan.h) over the C++ library: the offload Engine through a handle that owns it
// (and, for "runtime": "host" or "cuda", its runtime); estimate / plan / capacity are
// c_api_requests.cc's, through integration::requests.
//
// Every exported function runs its body inside Guard(), which turns a non-OK Status into a
// memplan_status plus this thread's last-error message, and catches every C++ exception so that
// none crosses into C (std::bad_alloc -> MEMPLAN_RESOURCE_EXHAUSTED, anything else ->
// MEMPLAN_INTERNAL). The library is built with hidden visibility (and links the static libraries
// with --exclude-libs); MEMPLAN_C_EXPORT marks the memplan_* functions, the only memplan symbols it
// exports (the c_api_symbols test checks).
//
// Note [Deferred registration]: the Engine takes a parameter's tied uses (ParamSpec::also_used_by)
// with the parameter itself, but the C API adds them one call later (memplan_engine_add_use). So
// the handle keeps the specs and gives them to Engine::AddParameter in memplan_engine_start, in
// registration order; the Engine numbers parameters in that order, and the handle checks it got
// the ids it handed out. memplan_engine_register checks what AddParameter would (name, module,
// shape, duplicates) so that mistakes are reported by the call that made them.
//
// Thread safety: as memplan.h says. The last error is thread-local; one handle is driven by one
// thread at a time, so the handle has no lock.
#include "memplan.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/json.h"
#include "common/status.h"
#include "integration/c_api_internal.h"
#include "integration/engine_json.h"
#include "offload/engine.h"
#include "gpu/gpu_runtime.h"
#include "schedule/schedule.h"

#ifndef MEMPLAN_VERSION
#define MEMPLAN_VERSION "unknown"
#endif

using memplan::Result;
using memplan::Status;
using memplan::StatusCode;

namespace {

// The dimensions a parameter may have; more is a mistake (a garbage ndim), not a tensor.
constexpr int32_t kMaxDims = 64;

// This thread's last error. `fallback` is used when the message itself cannot be allocated.
thread_local std::string last_error;
thread_local const char* last_error_fallback = nullptr;

}  // namespace

namespace memplan::capi {

void SetLastError(const char* function, const std::string& message) noexcept {
  try {
    last_error.assign(function);
    last_error.append(": ");
    last_error.append(message);
    last_error_fallback = nullptr;
  } catch (...) {
    last_error_fallback = "out of memory while recording an error message";
  }
}

memplan_status ToC(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return MEMPLAN_OK;
    case StatusCode::kInvalidArgument: return MEMPLAN_INVALID_ARGUMENT;
    case StatusCode::kNotFound: return MEMPLAN_NOT_FOUND;
    case StatusCode::kIoError: return MEMPLAN_IO_ERROR;
    case StatusCode::kOutOfRange: return MEMPLAN_OUT_OF_RANGE;
    case StatusCode::kFailedPrecondition: return MEMPLAN_FAILED_PRECONDITION;
    case StatusCode::kResourceExhausted: return MEMPLAN_RESOURCE_EXHAUSTED;
    case StatusCode::kUnimplemented: return MEMPLAN_UNIMPLEMENTED;
    case StatusCode::kDataLoss: return MEMPLAN_DATA_LOSS;
    case StatusCode::kUnavailable: return MEMPLAN_UNAVAILABLE;
    case StatusCode::kInternal: return MEMPLAN_INTERNAL;
  }
  return MEMPLAN_INTERNAL;
}

Status NullArgument(const char* name) {
  return Status::InvalidArgument(std::string(name) + " is NULL");
}

Status GiveString(const std::string& text, char** out) {
  char* copy = static_cast<char*>(std::malloc(text.size() + 1));
  if (copy == nullptr) {
    return Status::ResourceExhausted("out of memory for a " + std::to_string(text.size()) +
                                     "-byte answer");
  }
  std::memcpy(copy, text.data(), text.size() + 1);
  *out = copy;
  return Status::Ok();
}

std::string Dump(const nlohmann::json& json) {
  return json.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace memplan::capi

using memplan::capi::Dump;
using memplan::capi::GiveString;
using memplan::capi::Guard;
using memplan::capi::NullArgument;

// The handle behind memplan_engine*. Members are destroyed in reverse order: the engine before the
// runtime it uses.
struct memplan_engine {
  struct Param {
    memplan::offload::ParamSpec spec;
    uint64_t numel = 0;
    const float* init = nullptr;  // the caller's, read during start; null: zeros
  };

  std::unique_ptr<memplan::gpu::Runtime> runtime;  // null: the engine chose (and owns) one
  std::unique_ptr<memplan::offload::Engine> engine;
  memplan::offload::SwapOptimizer optimizer = memplan::offload::SwapOptimizer::kAdam;
  std::vector<Param> params;  // in registration order = ParamId (Note [Deferred registration])
  size_t params_added = 0;    // how many of `params` the Engine has (a failed start may retry)
  bool started = false;

  Status CheckParam(uint32_t id) const {
    if (id >= params.size()) {
      return Status::InvalidArgument("unknown parameter id " + std::to_string(id) + " (" +
                                     std::to_string(params.size()) + " registered)");
    }
    return Status::Ok();
  }
  Status CheckNotStarted() const {
    if (started) return Status::FailedPrecondition("the engine has already started");
    return Status::Ok();
  }
};

namespace {

using memplan::offload::ElementType;

// A C enum argument as the int the C caller passed. C may pass any int; in C++ loading an enum
// object that holds a value outside the enum's range is undefined, so the bits are copied out.
template <typename Enum>
int EnumValue(const Enum& value) {
  static_assert(sizeof(Enum) == sizeof(int));
  int raw = 0;
  std::memcpy(&raw, &value, sizeof raw);
  return raw;
}

Result<ElementType> ToElementType(int dtype) {
  switch (dtype) {
    case MEMPLAN_FLOAT32: return ElementType::kFloat32;
    case MEMPLAN_BFLOAT16: return ElementType::kBFloat16;
    case MEMPLAN_FLOAT16: return ElementType::kFloat16;
    default: break;
  }
  return Status::InvalidArgument("dtype " + std::to_string(dtype) + " is not a memplan_dtype");
}

Status Open(const char* schedule_json, const char* options_json, memplan_engine** out) {
  namespace offload = memplan::offload;
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json schedule_doc,
                           memplan::ParseJson(schedule_json, "schedule"));
  MEMPLAN_ASSIGN_OR_RETURN(offload::Schedule schedule,
                           offload::ScheduleFromJson(schedule_doc, "schedule"));
  nlohmann::json options_doc;  // null: defaults
  if (options_json != nullptr) {
    MEMPLAN_ASSIGN_OR_RETURN(options_doc, memplan::ParseJson(options_json, "engine options"));
  }
  MEMPLAN_ASSIGN_OR_RETURN(memplan::integration::EngineOpenOptions open,
                           memplan::integration::EngineOpenOptionsFromJson(options_doc));

  auto handle = std::make_unique<memplan_engine>();
  if (open.runtime == "host") {
    handle->runtime = memplan::gpu::CreateHostOnlyRuntime();
  } else if (open.runtime == "cuda") {
    MEMPLAN_ASSIGN_OR_RETURN(handle->runtime, memplan::gpu::CreateCudaRuntime(open.device));
  }
  offload::EngineOptions options;
  options.schedule = schedule;
  options.runtime = handle->runtime.get();
  options.device = open.device;
  options.resume = open.resume;
  MEMPLAN_ASSIGN_OR_RETURN(handle->engine, offload::Engine::Create(options));
  handle->optimizer = schedule.optimizer;
  *out = handle.release();
  return Status::Ok();
}

Status Register(memplan_engine* e, const char* name, const char* module, const int64_t* shape,
                int32_t ndim, const float* init, uint32_t* param_id) {
  MEMPLAN_RETURN_IF_ERROR(e->CheckNotStarted());
  if (*name == '\0') return Status::InvalidArgument("name is empty");
  if (*module == '\0') {
    return Status::InvalidArgument("module of " + std::string(name) + " is empty");
  }
  if (ndim < 0 || ndim > kMaxDims) {
    return Status::InvalidArgument("parameter " + std::string(name) + ": ndim " +
                                   std::to_string(ndim) + " is not in [0, " +
                                   std::to_string(kMaxDims) + "]");
  }
  if (ndim > 0 && shape == nullptr) return NullArgument("shape");
  memplan_engine::Param p;
  p.spec.name = name;
  p.spec.module = module;
  p.numel = 1;
  for (int32_t i = 0; i < ndim; ++i) {
    const int64_t d = shape[i];
    if (d <= 0) {
      return Status::InvalidArgument("parameter " + p.spec.name + ": dimension " +
                                     std::to_string(i) + " is " + std::to_string(d));
    }
    // The Engine's own limit (2^40 elements), checked here so that numel never overflows.
    if (p.numel > (uint64_t{1} << 40) / static_cast<uint64_t>(d)) {
      return Status::InvalidArgument("parameter " + p.spec.name + " is implausibly large");
    }
    p.numel *= static_cast<uint64_t>(d);
    p.spec.shape.push_back(d);
  }
  for (const memplan_engine::Param& other : e->params) {
    if (other.spec.name == p.spec.name) {
      return Status::InvalidArgument("parameter " + p.spec.name + " registered twice");
    }
  }
  if (e->params.size() >= std::numeric_limits<uint32_t>::max()) {
    return Status::OutOfRange("too many parameters");
  }
  p.init = init;
  e->params.push_back(std::move(p));
  *param_id = static_cast<uint32_t>(e->params.size() - 1);
  return Status::Ok();
}

Status Start(memplan_engine* e) {
  MEMPLAN_RETURN_IF_ERROR(e->CheckNotStarted());
  for (; e->params_added < e->params.size(); ++e->params_added) {
    memplan_engine::Param& p = e->params[e->params_added];
    const float* init = p.init;
    const uint64_t numel = p.numel;
    p.spec.init = [init, numel](uint64_t first, std::span<float> out) -> Status {
      if (first > numel || out.size() > numel - first) {
        return Status::Internal("init range [" + std::to_string(first) + ", +" +
                                std::to_string(out.size()) + ") outside the parameter");
      }
      if (init == nullptr) {
        std::fill(out.begin(), out.end(), 0.0f);
      } else {
        std::memcpy(out.data(), init + first, out.size() * sizeof(float));
      }
      return Status::Ok();
    };
    MEMPLAN_ASSIGN_OR_RETURN(memplan::offload::ParamId id, e->engine->AddParameter(p.spec));
    if (id != e->params_added) {
      return Status::Internal("the engine numbered parameter " + p.spec.name + " " +
                              std::to_string(id) + ", expected " + std::to_string(e->params_added));
    }
  }
  MEMPLAN_RETURN_IF_ERROR(e->engine->Start());
  e->started = true;
  return Status::Ok();
}

}  // namespace

// ---- Library ------------------------------------------------------------------------------------

MEMPLAN_C_EXPORT uint32_t memplan_abi_version(void) { return MEMPLAN_ABI_VERSION; }

MEMPLAN_C_EXPORT const char* memplan_version(void) { return MEMPLAN_VERSION; }

MEMPLAN_C_EXPORT const char* memplan_status_name(memplan_status status) {
  switch (EnumValue(status)) {
    case MEMPLAN_OK: return "OK";
    case MEMPLAN_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case MEMPLAN_NOT_FOUND: return "NOT_FOUND";
    case MEMPLAN_IO_ERROR: return "IO_ERROR";
    case MEMPLAN_OUT_OF_RANGE: return "OUT_OF_RANGE";
    case MEMPLAN_FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case MEMPLAN_RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case MEMPLAN_UNIMPLEMENTED: return "UNIMPLEMENTED";
    case MEMPLAN_DATA_LOSS: return "DATA_LOSS";
    case MEMPLAN_UNAVAILABLE: return "UNAVAILABLE";
    case MEMPLAN_INTERNAL: return "INTERNAL";
  }
  return "UNKNOWN";
}

MEMPLAN_C_EXPORT const char* memplan_last_error(void) {
  return last_error_fallback != nullptr ? last_error_fallback : last_error.c_str();
}

MEMPLAN_C_EXPORT void memplan_string_free(char* text) { std::free(text); }

// ---- Offload engine -----------------------------------------------------------------------------

MEMPLAN_C_EXPORT memplan_status memplan_engine_open(const char* schedule_json,
                                                    const char* options_json,
                                                    memplan_engine** engine) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    *engine = nullptr;
    if (schedule_json == nullptr) return NullArgument("schedule_json");
    return Open(schedule_json, options_json, engine);
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_register(memplan_engine* engine, const char* name,
                                                        const char* module, const int64_t* shape,
                                                        int32_t ndim, const float* init,
                                                        uint32_t* param_id) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (name == nullptr) return NullArgument("name");
    if (module == nullptr) return NullArgument("module");
    if (param_id == nullptr) return NullArgument("param_id");
    return Register(engine, name, module, shape, ndim, init, param_id);
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_add_use(memplan_engine* engine, uint32_t param_id,
                                                       const char* module) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (module == nullptr) return NullArgument("module");
    MEMPLAN_RETURN_IF_ERROR(engine->CheckNotStarted());
    MEMPLAN_RETURN_IF_ERROR(engine->CheckParam(param_id));
    if (*module == '\0') return Status::InvalidArgument("module is empty");
    engine->params[param_id].spec.also_used_by.emplace_back(module);
    return Status::Ok();
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_no_gradient(memplan_engine* engine,
                                                           uint32_t param_id) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (engine->engine == nullptr) return Status::FailedPrecondition("engine: not started");
    return engine->engine->NoGradient(param_id);
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_freeze(memplan_engine* engine, uint32_t param_id) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    MEMPLAN_RETURN_IF_ERROR(engine->CheckNotStarted());
    MEMPLAN_RETURN_IF_ERROR(engine->CheckParam(param_id));
    engine->params[param_id].spec.frozen = true;
    return Status::Ok();
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_set_group(memplan_engine* engine, uint32_t param_id,
                                                         uint32_t group) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    MEMPLAN_RETURN_IF_ERROR(engine->CheckNotStarted());
    MEMPLAN_RETURN_IF_ERROR(engine->CheckParam(param_id));
    if (group >= 1024) {
      return Status::InvalidArgument("group " + std::to_string(group) + ": groups are 0 .. 1023");
    }
    engine->params[param_id].spec.group = group;
    return Status::Ok();
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_start(memplan_engine* engine) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    return Start(engine);
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_fetch(memplan_engine* engine, const char* module) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (module == nullptr) return NullArgument("module");
    return engine->engine->Fetch(module);
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_release(memplan_engine* engine, const char* module) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (module == nullptr) return NullArgument("module");
    return engine->engine->Release(module);
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_release_on_stream(memplan_engine* engine,
                                                                 const char* module, void* stream) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (module == nullptr) return NullArgument("module");
    return engine->engine->Release(module, memplan::gpu::Stream{stream});
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_gradient_stream(memplan_engine* engine,
                                                               void** stream) {
  return Guard(__func__, [&]() -> Status {
    if (stream == nullptr) return NullArgument("stream");
    *stream = nullptr;
    if (engine == nullptr) return NullArgument("engine");
    *stream = engine->engine->GradientStream().handle;
    return Status::Ok();
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_device_pointer(memplan_engine* engine,
                                                              uint32_t param_id, void** pointer) {
  return Guard(__func__, [&]() -> Status {
    if (pointer == nullptr) return NullArgument("pointer");
    *pointer = nullptr;
    if (engine == nullptr) return NullArgument("engine");
    MEMPLAN_RETURN_IF_ERROR(engine->CheckParam(param_id));
    MEMPLAN_ASSIGN_OR_RETURN(*pointer, engine->engine->DevicePointer(param_id));
    return Status::Ok();
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_numel(memplan_engine* engine, uint32_t param_id,
                                                     uint64_t* numel) {
  return Guard(__func__, [&]() -> Status {
    if (numel == nullptr) return NullArgument("numel");
    *numel = 0;
    if (engine == nullptr) return NullArgument("engine");
    MEMPLAN_RETURN_IF_ERROR(engine->CheckParam(param_id));
    *numel = engine->params[param_id].numel;
    return Status::Ok();
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_grad_ready(memplan_engine* engine, uint32_t param_id,
                                                          const void* grad, memplan_dtype dtype) {
  const int raw_dtype = EnumValue(dtype);
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (grad == nullptr) return NullArgument("grad");
    MEMPLAN_RETURN_IF_ERROR(engine->CheckParam(param_id));
    MEMPLAN_ASSIGN_OR_RETURN(ElementType type, ToElementType(raw_dtype));
    return engine->engine->GradReady(param_id, grad, type);
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_grad_ready_on_stream(memplan_engine* engine,
                                                                    uint32_t param_id,
                                                                    const void* grad,
                                                                    memplan_dtype dtype,
                                                                    void* stream) {
  const int raw_dtype = EnumValue(dtype);
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (grad == nullptr) return NullArgument("grad");
    MEMPLAN_RETURN_IF_ERROR(engine->CheckParam(param_id));
    MEMPLAN_ASSIGN_OR_RETURN(ElementType type, ToElementType(raw_dtype));
    return engine->engine->GradReady(param_id, grad, type, memplan::gpu::Stream{stream});
  });
}

namespace {

// The options of a step or a prepared step: `options_json` (null: the defaults) for the
// engine's optimizer.
Result<memplan::offload::StepOptions> StepOptions(const memplan_engine& engine,
                                                  const char* options_json) {
  nlohmann::json doc = nlohmann::json::object();
  if (options_json != nullptr) {
    MEMPLAN_ASSIGN_OR_RETURN(doc, memplan::ParseJson(options_json, "step options"));
  }
  return memplan::integration::EngineStepOptionsFromJson(doc, engine.optimizer);
}

}  // namespace

MEMPLAN_C_EXPORT memplan_status memplan_engine_step(memplan_engine* engine,
                                                    const char* options_json) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    MEMPLAN_ASSIGN_OR_RETURN(memplan::offload::StepOptions options,
                             StepOptions(*engine, options_json));
    return engine->engine->Step(options);
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_prepare_step(memplan_engine* engine,
                                                            const char* options_json) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    MEMPLAN_ASSIGN_OR_RETURN(memplan::offload::StepOptions options,
                             StepOptions(*engine, options_json));
    return engine->engine->PrepareStep(options);
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_read_master(memplan_engine* engine,
                                                           uint32_t param_id, float* out,
                                                           uint64_t count) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (out == nullptr) return NullArgument("out");
    MEMPLAN_RETURN_IF_ERROR(engine->CheckParam(param_id));
    const memplan_engine::Param& p = engine->params[param_id];
    if (count != p.numel) {
      return Status::InvalidArgument("count " + std::to_string(count) + ": parameter " +
                                     p.spec.name + " has " + std::to_string(p.numel) + " elements");
    }
    return engine->engine->ReadMasterWeights(param_id, std::span<float>(out, count));
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_gradient_norm(memplan_engine* engine,
                                                             double norm_type, double grad_scale,
                                                             double* norm) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (norm == nullptr) return NullArgument("norm");
    if (!engine->started) return Status::FailedPrecondition("the engine has not started");
    MEMPLAN_ASSIGN_OR_RETURN(*norm, engine->engine->GradientNorm(norm_type, grad_scale));
    return Status::Ok();
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_abandon_step(memplan_engine* engine) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (!engine->started) return Status::FailedPrecondition("the engine has not started");
    return engine->engine->AbandonStep();
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_shard(memplan_engine* engine, uint32_t param_id,
                                                     uint64_t* first, uint64_t* size) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (first == nullptr) return NullArgument("first");
    if (size == nullptr) return NullArgument("size");
    MEMPLAN_RETURN_IF_ERROR(engine->CheckParam(param_id));
    MEMPLAN_ASSIGN_OR_RETURN(const memplan::offload::ParamShard shard,
                             engine->engine->Shard(param_id));
    *first = shard.first;
    *size = shard.size;
    return Status::Ok();
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_optimizer_states(memplan_engine* engine,
                                                                int32_t* states) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (states == nullptr) return NullArgument("states");
    *states = engine->engine->OptimizerStates();
    return Status::Ok();
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_read_state(memplan_engine* engine, uint32_t param_id,
                                                          int32_t array, float* out,
                                                          uint64_t count) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (out == nullptr) return NullArgument("out");
    MEMPLAN_RETURN_IF_ERROR(engine->CheckParam(param_id));
    return engine->engine->ReadOptimizerState(param_id, array, std::span<float>(out, count));
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_param_step(memplan_engine* engine, uint32_t param_id,
                                                          uint64_t* step) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (step == nullptr) return NullArgument("step");
    MEMPLAN_RETURN_IF_ERROR(engine->CheckParam(param_id));
    MEMPLAN_ASSIGN_OR_RETURN(*step, engine->engine->ParamStepCount(param_id));
    return Status::Ok();
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_load_state(memplan_engine* engine,
                                                          memplan_state_filler fill, void* user,
                                                          const uint8_t* arrays, int32_t narrays,
                                                          const uint64_t* steps, uint64_t nsteps) {
  return Guard(__func__, [&]() -> Status {
    if (engine == nullptr) return NullArgument("engine");
    if (fill == nullptr) return NullArgument("fill");
    if (arrays == nullptr || narrays <= 0) return NullArgument("arrays");
    if (steps == nullptr && nsteps != 0) return NullArgument("steps");
    const auto n = static_cast<size_t>(narrays);
    std::unique_ptr<bool[]> flags(new bool[n]);
    for (size_t k = 0; k < n; ++k) flags[k] = arrays[k] != 0;
    memplan::offload::StateFiller filler = [fill, user](uint32_t param, int array, uint64_t first,
                                                        std::span<float> out) -> Status {
      if (fill(user, param, array, first, out.data(), out.size()) != 0) {
        return Status::InvalidArgument("the state filler failed for parameter " +
                                       std::to_string(param) + ", array " + std::to_string(array));
      }
      return Status::Ok();
    };
    return engine->engine->LoadOptimizerState(
        filler, std::span<const bool>(flags.get(), n),
        std::span<const uint64_t>(steps, static_cast<size_t>(nsteps)));
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_stats_json(memplan_engine* engine,
                                                          char** stats_json) {
  return Guard(__func__, [&]() -> Status {
    if (stats_json == nullptr) return NullArgument("stats_json");
    *stats_json = nullptr;
    if (engine == nullptr) return NullArgument("engine");
    return GiveString(Dump(memplan::integration::ToJson(engine->engine->stats())), stats_json);
  });
}

MEMPLAN_C_EXPORT memplan_status memplan_engine_close(memplan_engine* engine) {
  if (engine == nullptr) return MEMPLAN_OK;
  std::unique_ptr<memplan_engine> owned(engine);  // freed on every path out
  return Guard(__func__, [&]() -> Status {
    Status status = owned->engine->Close();
    owned.reset();  // the engine's threads stop here; its destructor's errors are not reported
    return status;
  });
}
