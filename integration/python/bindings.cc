// memplan._native: the pybind11 extension under the `memplan` Python package.
//
// Deliberately thin: estimate and plan take and return JSON text (the package's __init__.py turns
// dicts into JSON and back), so Python sees exactly the documents the CLI and the C API produce.
// The Engine class wraps offload::Engine; tensors cross without copies: any object with the buffer
// protocol (numpy arrays, bytearray, memoryview) or a torch tensor (read through data_ptr(), so
// CUDA tensors work and the extension does not link libtorch).
//
// The GIL is released while the engine works (start, fetch, release, grad_ready, step), so the
// engine's own threads and other Python threads run meanwhile.
//
// Streams (offload/engine.h, "Streams"): release and grad_ready take the caller's CUDA stream as
// an integer handle (torch.cuda.current_stream().cuda_stream; 0: the legacy default stream). A
// CUDA gradient is copied on the engine's gradient stream after grad_ready returns; the binding
// records the tensor on that stream (tensor.record_stream, so PyTorch's caching allocator does not
// reuse its memory before the copy has read it) and drops its reference at once, so backward does
// not keep every gradient alive until step().
//
// Note [A collective backed by Python]
// Across processes (memplan.torch with torch.distributed) the engine's Collective is either NCCL
// (CUDA: the engine's own NcclCollective; the ranks agree on its unique id through the process
// group) or, for the host runtime, PyCollective below: a Collective whose three calls go to a
// Python object (memplan.torch's process-group collective, over gloo). The engine stays free of
// Python: it only sees the Collective seam. The engine calls its Collective only on the thread
// that called it (engine.h: Start, Fetch, GradReady, Step, ReadMasterWeights), and every binding
// releases the GIL around those calls; so PyCollective takes the GIL back for the Python call
// (gil_scoped_acquire on the same thread: no other thread is involved, nothing can deadlock on
// the GIL) and releases it again when it returns. A Python exception becomes an IoError naming the
// call, raised to the caller of the engine call as OSError; the ranks then fail as with NCCL.
//
// Note [Python exceptions]
// One mapping from Status to Python for every call (Raise()), so the package's errors mean one
// thing: a Status made from an errno (Status::FromErrno, sys_errno()) is OSError(errno, message),
// which Python turns into FileNotFoundError, PermissionError, ... by the errno (a store file
// removed between steps, a full disk); other I/O failures and data loss are OSError; bad input and
// ranges are ValueError; a name that is not found (a model, a module) is memplan.NotFoundError, a
// ValueError (bad input, as the README promises for the requests) that is also a KeyError (as it
// was), printed without KeyError's quotes; a budget is MemoryError; a call out of order (a closed
// engine, a step before its backward) is RuntimeError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/json.h"
#include "integration/engine_json.h"
#include "integration/requests.h"
#include "nvme/backend.h"
#include "nvme/io_engine.h"
#include "offload/cpu_optimizer.h"
#include "offload/engine.h"
#include "gpu/gpu_runtime.h"
#include "schedule/schedule.h"

namespace py = pybind11;

namespace memplan::python {
namespace {

// Raises the Python exception that matches `status` (Note [Python exceptions]): an OS error's
// errno as OSError(errno, message), which Python turns into FileNotFoundError, PermissionError...;
// other I/O failures and data loss as OSError; bad input, a name not found (memplan.NotFoundError,
// both a ValueError and a KeyError) and ranges as ValueError; a budget as MemoryError; misuse
// (a call out of order) as RuntimeError.
[[noreturn]] void Raise(const Status& status) {
  const std::string message = status.message();
  if (status.sys_errno() != 0) {
    py::object error = py::reinterpret_steal<py::object>(
        PyObject_CallFunction(PyExc_OSError, "is", status.sys_errno(), message.c_str()));
    if (!error) throw py::error_already_set();
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    throw py::error_already_set();
  }
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange: throw py::value_error(message);
    case StatusCode::kNotFound: {
      py::object type = py::module_::import("memplan").attr("NotFoundError");
      PyErr_SetObject(type.ptr(), py::str(message).ptr());
      throw py::error_already_set();
    }
    case StatusCode::kIoError:
    case StatusCode::kDataLoss:
      PyErr_SetString(PyExc_OSError, message.c_str());
      throw py::error_already_set();
    case StatusCode::kResourceExhausted:
      PyErr_SetString(PyExc_MemoryError, message.c_str());
      throw py::error_already_set();
    case StatusCode::kUnimplemented:
      PyErr_SetString(PyExc_NotImplementedError, message.c_str());
      throw py::error_already_set();
    default: throw std::runtime_error(message);
  }
}

void Check(const Status& status) {
  if (!status.ok()) Raise(status);
}

template <typename T>
T Value(Result<T> result) {
  if (!result.ok()) Raise(result.status());
  return std::move(*result);
}

nlohmann::json ParseRequest(const std::string& text, const char* what) {
  return Value(ParseJson(text, what));
}

// A request's JSON text through `answer` (integration/requests.h), with the GIL released while it
// works; its JSON text back.
std::string Answer(const std::string& request, const char* what,
                   Result<nlohmann::json> (*answer)(const nlohmann::json&)) {
  nlohmann::json doc = ParseRequest(request, what);
  Result<nlohmann::json> result = Status::Internal("unset");
  {
    py::gil_scoped_release release;
    result = answer(doc);
  }
  return Value(std::move(result)).dump();
}

// A contiguous block of memory from a Python object, without a copy.
struct Memory {
  const void* data = nullptr;
  uint64_t bytes = 0;
  std::string dtype;    // "fp32", "bf16", "fp16", or the format we could not map
  bool device = false;  // memory of a CUDA tensor
  py::object keep;      // keeps the owner alive (and a buffer_info's release)
};

Memory MemoryOf(const py::object& obj) {
  Memory m;
  if (py::hasattr(obj, "data_ptr") && py::hasattr(obj, "element_size")) {  // a torch tensor
    if (!obj.attr("is_contiguous")().cast<bool>()) {
      throw py::value_error("memplan: tensor is not contiguous; call .contiguous() first");
    }
    m.data = reinterpret_cast<const void*>(obj.attr("data_ptr")().cast<uintptr_t>());
    m.bytes = obj.attr("numel")().cast<uint64_t>() * obj.attr("element_size")().cast<uint64_t>();
    const std::string dtype = py::str(obj.attr("dtype"));
    m.dtype = dtype == "torch.float32"    ? "fp32"
              : dtype == "torch.bfloat16" ? "bf16"
              : dtype == "torch.float16"  ? "fp16"
                                          : dtype;
    m.device = py::str(obj.attr("device").attr("type")).cast<std::string>() == "cuda";
    m.keep = obj;
    return m;
  }
  if (!PyObject_CheckBuffer(obj.ptr())) {
    throw py::type_error("memplan: expected a torch tensor or a buffer-protocol object, not " +
                         std::string(py::str(py::type::of(obj))));
  }
  py::buffer buffer = py::reinterpret_borrow<py::buffer>(obj);
  py::buffer_info info = buffer.request();
  // C-contiguous check: strides of a row-major array.
  py::ssize_t expected = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] > 1 && info.strides[d] != expected) {
      throw py::value_error("memplan: buffer is not C-contiguous");
    }
    expected *= info.shape[d];
  }
  m.data = info.ptr;
  m.bytes = static_cast<uint64_t>(info.size * info.itemsize);
  m.dtype = info.format == "f" ? "fp32" : info.format == "e" ? "fp16" : info.format;
  m.keep = obj;
  return m;
}

offload::ElementType ElementTypeOf(const Memory& m, const std::string& given) {
  const std::string name = given.empty() ? m.dtype : given;
  auto type = offload::ParseElementType(name);
  if (!type.ok()) {
    throw py::value_error("memplan: element type " + name +
                          " is not one of fp32, bf16, fp16 (pass dtype=... for raw buffers)");
  }
  return *type;
}

// The Collective over a Python object with rank, world_size and all_gather / reduce_scatter /
// all_reduce(send, recv, count, dtype) taking writable memoryviews of host memory (Note [A
// collective backed by Python]). Host memory only: the engine's host runtime.
class PyCollective final : public offload::Collective {
 public:
  PyCollective(py::object impl, int rank, int world_size)
      : impl_(std::move(impl)), rank_(rank), world_size_(world_size) {}
  ~PyCollective() override {
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }

  std::string_view Name() const override { return "torch.distributed"; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  Status AllGather(const void* send, void* recv, uint64_t count,
                   offload::ElementType type) override {
    const uint64_t bytes = count * static_cast<uint64_t>(offload::ElementBytes(type));
    return Call("all_gather", send, bytes, recv, bytes * static_cast<uint64_t>(world_size_), count,
                type);
  }
  Status ReduceScatter(const void* send, void* recv, uint64_t count,
                       offload::ElementType type) override {
    const uint64_t bytes = count * static_cast<uint64_t>(offload::ElementBytes(type));
    return Call("reduce_scatter", send, bytes * static_cast<uint64_t>(world_size_), recv, bytes,
                count, type);
  }
  Status AllReduce(void* buffer, uint64_t count, offload::ElementType type) override {
    const uint64_t bytes = count * static_cast<uint64_t>(offload::ElementBytes(type));
    return Call("all_reduce", buffer, bytes, buffer, bytes, count, type);
  }

 private:
  Status Call(const char* what, const void* send, uint64_t send_bytes, void* recv,
              uint64_t recv_bytes, uint64_t count, offload::ElementType type) {
    if (count == 0) return Status::Ok();
    py::gil_scoped_acquire gil;
    try {
      auto view = [](const void* p, uint64_t bytes) {
        return py::memoryview::from_memory(const_cast<void*>(p), static_cast<py::ssize_t>(bytes),
                                           /*readonly=*/false);
      };
      impl_.attr(what)(view(send, send_bytes), view(recv, recv_bytes), count,
                       std::string(offload::ElementTypeName(type)));
      return Status::Ok();
    } catch (py::error_already_set& e) {
      return Status::IoError(std::string("torch.distributed ") + what + " failed: " + e.what());
    } catch (const std::exception& e) {
      return Status::IoError(std::string("torch.distributed ") + what + " failed: " + e.what());
    }
  }

  py::object impl_;
  int rank_;
  int world_size_;
};

// The engine's collective from the `collective` argument of Engine(): None (one process); an
// object with `nccl_unique_id` (bytes), `rank` and `world_size` (NCCL on the CUDA runtime); or an
// object with `rank`, `world_size` and the three calls (PyCollective, host runtime).
std::unique_ptr<offload::Collective> MakeCollective(const py::object& collective,
                                                    gpu::Runtime* runtime) {
  if (collective.is_none()) return nullptr;
  const int rank = collective.attr("rank").cast<int>();
  const int world_size = collective.attr("world_size").cast<int>();
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw py::value_error("memplan: collective rank " + std::to_string(rank) +
                          " is outside world size " + std::to_string(world_size));
  }
  if (py::hasattr(collective, "nccl_unique_id")) {
    const std::string id = collective.attr("nccl_unique_id").cast<py::bytes>();
    std::unique_ptr<offload::Collective> nccl;
    Status status;
    {
      py::gil_scoped_release release;  // blocks until every rank has joined
      auto made = offload::CreateNcclCollective(runtime, rank, world_size, id);
      if (made.ok()) {
        nccl = std::move(*made);
      } else {
        status = made.status();
      }
    }
    Check(status);
    return nccl;
  }
  if (runtime->has_device()) {
    throw py::value_error("memplan: a Python-backed collective needs the host runtime; on " +
                          std::string(runtime->Name()) + " the ranks use NCCL");
  }
  return std::make_unique<PyCollective>(collective, rank, world_size);
}

class PyEngine {
 public:
  PyEngine(const std::string& schedule_json, const std::string& options_json,
           const py::object& collective) {
    nlohmann::json schedule_doc = ParseRequest(schedule_json, "schedule");
    schedule_ = Value(offload::ScheduleFromJson(schedule_doc, "schedule"));
    integration::EngineOpenOptions open = Value(integration::EngineOpenOptionsFromJson(
        options_json.empty() ? nlohmann::json() : ParseRequest(options_json, "engine options")));
    offload::EngineOptions options;
    options.schedule = schedule_;
    options.resume = open.resume;
    if (open.runtime == "host") {
      runtime_ = gpu::CreateHostOnlyRuntime();
    } else if (open.runtime == "cuda") {
      runtime_ = Value(gpu::CreateCudaRuntime(open.device));
    } else {
      runtime_ = gpu::CreateBestRuntime(nullptr, open.device);
    }
    options.runtime = runtime_.get();
    collective_ = MakeCollective(collective, runtime_.get());
    options.collective = collective_.get();
    engine_ = Value(offload::Engine::Create(options));
  }

  uint32_t AddParameter(const std::string& name, const std::string& module,
                        const std::vector<int64_t>& shape, const py::object& init,
                        const std::vector<std::string>& also_used_by, bool frozen, uint32_t group,
                        const std::string& dtype) {
    Require();
    offload::ParamSpec spec;
    spec.frozen = frozen;
    spec.group = group;
    spec.dtype = dtype;
    spec.name = name;
    spec.module = module;
    spec.shape = shape;
    spec.also_used_by = also_used_by;
    uint64_t numel = 1;
    for (int64_t d : shape) numel *= static_cast<uint64_t>(d > 0 ? d : 0);
    if (init.is_none()) {
      spec.init = [](uint64_t, std::span<float> out) {
        std::fill(out.begin(), out.end(), 0.0f);
        return Status::Ok();
      };
    } else if (PyCallable_Check(init.ptr()) != 0) {
      // Note [Initial values made on demand].
      const size_t index = makers_.size();
      makers_.push_back(init);
      spec.init = [this, index, name, numel](uint64_t first, std::span<float> out) {
        return FillFromMaker(index, name, numel, first, out);
      };
    } else {
      Memory m = MemoryOf(init);
      if (m.device) throw py::value_error("memplan: init values must be in host memory");
      if (m.dtype != "fp32") {
        throw py::value_error("memplan: init values of " + name + " must be float32, not " +
                              m.dtype);
      }
      if (m.bytes != numel * 4) {
        throw py::value_error("memplan: init values of " + name + " have " +
                              std::to_string(m.bytes / 4) + " elements, the shape has " +
                              std::to_string(numel));
      }
      const auto* values = static_cast<const float*>(m.data);
      spec.init = [values](uint64_t first, std::span<float> out) {
        std::memcpy(out.data(), values + first, out.size() * sizeof(float));
        return Status::Ok();
      };
      keep_.push_back(m.keep);  // read during start()
    }
    const uint32_t id = Value(engine_->AddParameter(spec));
    if (numels_.size() <= id) numels_.resize(id + 1);
    numels_[id] = numel;
    return id;
  }

  py::dict Start() {
    Require();
    offload::RecoveryReport report;
    Status status;
    {
      py::gil_scoped_release release;
      status = engine_->Start(&report);
    }
    keep_.clear();
    makers_.clear();
    made_ = Made();
    Check(status);
    py::dict out;
    out["epoch"] = stats_epoch();
    out["torn"] = report.torn;
    out["notes"] = report.notes;
    return out;
  }

  void Fetch(const std::string& module) {
    Require();
    Status status;
    {
      py::gil_scoped_release release;
      status = engine_->Fetch(module);
    }
    Check(status);
  }

  void Release(const std::string& module, uintptr_t stream) {
    Require();
    Status status;
    {
      py::gil_scoped_release release;
      status = engine_->Release(module, gpu::Stream{reinterpret_cast<void*>(stream)});
    }
    Check(status);
  }

  void NoGradient(uint32_t param) {
    Require();
    Check(engine_->NoGradient(param));
  }

  uintptr_t GradientStream() const {
    Require();
    return reinterpret_cast<uintptr_t>(engine_->GradientStream().handle);
  }

  uintptr_t DevicePointer(uint32_t param) {
    Require();
    return reinterpret_cast<uintptr_t>(Value(engine_->DevicePointer(param)));
  }

  // The working copy of a fetched parameter as a writable memoryview (host runtime only: the
  // "device" memory is host memory there). Valid until the parameter's module is released.
  py::memoryview HostView(uint32_t param, uint64_t numel) {
    Require();
    if (runtime_->Name() != "host-only") {
      throw py::value_error("memplan: host_view() needs the host runtime; on " +
                            std::string(runtime_->Name()) + " use device_pointer()");
    }
    void* p = Value(engine_->DevicePointer(param));
    const auto bytes = static_cast<py::ssize_t>(
        numel * static_cast<uint64_t>(offload::ElementBytes(schedule_.param_dtype)));
    return py::memoryview::from_memory(p, bytes, /*readonly=*/false);
  }

  void GradReady(uint32_t param, const py::object& grad, const std::string& dtype,
                 uintptr_t stream) {
    Require();
    Memory m = MemoryOf(grad);
    const offload::ElementType type = ElementTypeOf(m, dtype);
    const bool device_runtime = runtime_->has_device();
    if (m.device && !device_runtime) {
      throw py::value_error("memplan: a CUDA gradient given to the " +
                            std::string(runtime_->Name()) +
                            " runtime; open the engine with runtime=\"cuda\"");
    }
    if (!m.device && device_runtime) {
      throw py::value_error("memplan: a host gradient given to the " +
                            std::string(runtime_->Name()) +
                            " runtime, which copies gradients from GPU memory");
    }
    Status status;
    {
      py::gil_scoped_release release;
      status =
          engine_->GradReady(param, m.data, type, gpu::Stream{reinterpret_cast<void*>(stream)});
    }
    Check(status);
    if (!device_runtime) return;  // copied before GradReady returned
    if (py::hasattr(grad, "record_stream")) {
      // Read later on the gradient stream: the caching allocator must wait for that copy before it
      // reuses the memory; then nothing needs the tensor any more.
      grad.attr("record_stream")(GradientStreamObject(grad));
      return;
    }
    grads_.push_back(m.keep);  // no allocator to tell: keep the buffer until step()
  }

  void Step(const std::string& options_json) {
    Require();
    offload::StepOptions options = StepOptions(options_json);
    Status status;
    {
      py::gil_scoped_release release;
      status = engine_->Step(options);
    }
    grads_.clear();
    Check(status);
  }

  void PrepareStep(const std::string& options_json) {
    Require();
    offload::StepOptions options = StepOptions(options_json);
    Status status;
    {
      py::gil_scoped_release release;
      status = engine_->PrepareStep(options);
    }
    Check(status);
  }

  // The options of a step or a prepared step: `options_json` ("" for the defaults) for the
  // schedule's optimizer.
  offload::StepOptions StepOptions(const std::string& options_json) const {
    nlohmann::json doc = options_json.empty() ? nlohmann::json::object()
                                              : ParseRequest(options_json, "step options");
    return Value(integration::EngineStepOptionsFromJson(doc, schedule_.optimizer));
  }

  double GradientNorm(double norm_type, double grad_scale) {
    Require();
    Result<double> norm = Status::Internal("unset");
    {
      py::gil_scoped_release release;  // a collective with world size > 1
      norm = engine_->GradientNorm(norm_type, grad_scale);
    }
    return Value(std::move(norm));
  }

  void AbandonStep() {
    Require();
    Status status;
    {
      py::gil_scoped_release release;
      status = engine_->AbandonStep();
    }
    grads_.clear();
    Check(status);
  }

  // (first, size, numel) of this rank's shard of `param` (Engine::Shard).
  py::tuple Shard(uint32_t param) const {
    Require();
    const offload::ParamShard shard = Value(engine_->Shard(param));
    return py::make_tuple(shard.first, shard.size, shard.numel);
  }

  int OptimizerStates() const {
    Require();
    return engine_->OptimizerStates();
  }

  void ReadState(uint32_t param, int array, const py::object& out) {
    Require();
    Memory m = MemoryOf(out);
    if (m.device || m.dtype != "fp32") {
      throw py::value_error("memplan: read_state needs a float32 host buffer");
    }
    Status status;
    {
      py::gil_scoped_release release;
      status = engine_->ReadOptimizerState(
          param, array,
          std::span<float>(static_cast<float*>(const_cast<void*>(m.data)), m.bytes / 4));
    }
    Check(status);
  }

  uint64_t ParamStep(uint32_t param) const {
    Require();
    return Value(engine_->ParamStepCount(param));
  }

  // `fill(param, array, first, count)` returns `count` float32 values (a buffer-protocol object or
  // a CPU tensor) of this rank's shard; called on this thread, with the GIL taken back for it.
  void LoadState(const py::object& fill, const std::vector<bool>& arrays,
                 const std::vector<uint64_t>& steps) {
    Require();
    offload::StateFiller filler = [&fill](offload::ParamId param, int array, uint64_t first,
                                          std::span<float> out) -> Status {
      py::gil_scoped_acquire acquire;
      try {
        py::object values = fill(param, array, first, out.size());
        Memory m = MemoryOf(values);
        if (m.device || m.dtype != "fp32" || m.bytes != out.size_bytes()) {
          return Status::InvalidArgument("the state filler gave " + std::to_string(m.bytes) +
                                         " bytes of " + m.dtype + " for " +
                                         std::to_string(out.size()) + " float32 values");
        }
        std::memcpy(out.data(), m.data, out.size_bytes());
        return Status::Ok();
      } catch (py::error_already_set& e) {
        // Kept for the caller: the engine's status names the parameter, Python's error the cause.
        return Status::InvalidArgument(std::string("the state filler raised ") + e.what());
      }
    };
    std::unique_ptr<bool[]> flags(new bool[arrays.size()]);
    for (size_t k = 0; k < arrays.size(); ++k) flags[k] = arrays[k];
    Status status;
    {
      py::gil_scoped_release release;
      status = engine_->LoadOptimizerState(
          filler, std::span<const bool>(flags.get(), arrays.size()), steps);
    }
    Check(status);
  }

  void ReadMaster(uint32_t param, const py::object& out) {
    Require();
    Memory m = MemoryOf(out);
    if (m.device || m.dtype != "fp32") {
      throw py::value_error("memplan: read_master needs a float32 host buffer");
    }
    if (param < numels_.size() && m.bytes / 4 != numels_[param]) {
      throw py::value_error("memplan: read_master: the buffer has " + std::to_string(m.bytes / 4) +
                            " elements, the parameter " + std::to_string(numels_[param]));
    }
    Status status;
    {
      py::gil_scoped_release release;  // a collective with world size > 1
      status = engine_->ReadMasterWeights(
          param, std::span<float>(static_cast<float*>(const_cast<void*>(m.data)), m.bytes / 4));
    }
    Check(status);
  }

  std::string StatsJson() const {
    Require();
    return integration::ToJson(engine_->stats()).dump();
  }

  std::string ParamDtype() const {
    return std::string(offload::ElementTypeName(schedule_.param_dtype));
  }
  std::string Runtime() const { return std::string(runtime_->Name()); }
  int Device() const { return runtime_->device(); }

  void Close() {
    if (!engine_) return;
    Status status;
    {
      py::gil_scoped_release release;
      status = engine_->Close();
    }
    engine_.reset();
    grads_.clear();
    keep_.clear();
    makers_.clear();
    made_ = Made();
    gradient_stream_ = py::object();
    Check(status);
  }

 private:
  // torch.cuda.ExternalStream over the engine's gradient stream, made once.
  py::object GradientStreamObject(const py::object& tensor) {
    if (!gradient_stream_) {
      py::object external = py::module_::import("torch").attr("cuda").attr("ExternalStream");
      gradient_stream_ = external(GradientStream(), py::arg("device") = tensor.attr("device"));
    }
    return gradient_stream_;
  }

  void Require() const {
    if (!engine_) throw std::runtime_error("memplan: the engine is closed");
  }

  // Note [Initial values made on demand]
  // add_parameter(init=callable): the callable makes the parameter's initial values (a float32
  // host tensor or buffer of its element count) when the engine first asks for them in start(),
  // and they are dropped once the engine has read the parameter's last element, or when it moves
  // on to another parameter. start() fills the stores in registration order, one sub-group at a
  // time, so at most one parameter's values exist at once: a model built on torch's meta device
  // (memplan.torch, Note [A model never materialised]) goes to the drive without ever being
  // whole in host memory. Called on start()'s thread with the GIL taken back; what the callable
  // raises fails start() with InvalidArgument naming the parameter.
  Status FillFromMaker(size_t index, const std::string& name, uint64_t numel, uint64_t first,
                       std::span<float> out) {
    py::gil_scoped_acquire gil;
    try {
      if (made_.index != index || !made_.keep) {
        made_ = Made();  // the previous parameter's values go before these are made
        py::object values = makers_.at(index)();
        Memory m = MemoryOf(values);
        if (m.device) return Status::InvalidArgument("the init of " + name + " gave device memory");
        if (m.dtype != "fp32" || m.bytes != numel * 4) {
          return Status::InvalidArgument(
              "the init of " + name + " gave " + m.dtype + " values of " + std::to_string(m.bytes) +
              " bytes; it must give " + std::to_string(numel) + " float32 values (" +
              std::to_string(numel * 4) + " bytes)");
        }
        made_.index = index;
        made_.data = static_cast<const float*>(m.data);
        made_.keep = m.keep;
      }
      if (first + out.size() > numel) {
        return Status::Internal("init of " + name + " asked past its end");
      }
      std::memcpy(out.data(), made_.data + first, out.size() * sizeof(float));
      if (first + out.size() == numel) made_ = Made();
      return Status::Ok();
    } catch (py::error_already_set& e) {
      return Status::InvalidArgument("the init of " + name + " raised " + e.what());
    } catch (const std::exception& e) {
      return Status::InvalidArgument("the init of " + name + " raised " + e.what());
    }
  }

  struct Made {  // the values a maker gave, until the engine has read them
    size_t index = 0;
    const float* data = nullptr;
    py::object keep;
  };
  uint64_t stats_epoch() const { return engine_->stats().epoch; }

  offload::Schedule schedule_;
  std::unique_ptr<gpu::Runtime> runtime_;
  std::unique_ptr<offload::Collective> collective_;  // null: one process
  std::unique_ptr<offload::Engine> engine_;          // destroyed before collective_ and runtime_
  std::vector<uint64_t> numels_;                     // by parameter id
  std::vector<py::object> keep_;                     // init buffers until start()
  std::vector<py::object> makers_;  // init callables until start() (Note [Initial values ...])
  Made made_;                       // the values of the parameter being initialised
  std::vector<py::object> grads_;   // gradients without record_stream, until step()
  py::object gradient_stream_;      // GradientStreamObject's
};

// memplan.IoFile: one file read and written through the NVMe IoEngine, for benchmarks that put
// memplan beside another I/O stack in one process (bench/vs_deepspeed.py). The GIL is released
// during transfers.
class PyIoFile {
 public:
  PyIoFile(const std::string& path, const std::string& backend, uint32_t block_size,
           uint32_t queue_depth, uint32_t threads, bool direct, bool create, bool sqpoll,
           bool fixed_files, uint32_t submit_batch) {
    nvme::BackendKind kind = Value(nvme::ParseBackendKind(backend));
    nvme::BackendOptions options;
    options.queue_depth = queue_depth;
    options.sqpoll = sqpoll;
    options.fixed_files = fixed_files;
    options.submit_batch = submit_batch;
    options.path = path;
    nvme::IoEngineOptions engine_options;
    engine_options.block_size = block_size;
    engine_options.threads = threads;
    Check(engine_options.Validate());
    set_ = Value(nvme::CreateBackends(kind, options, threads));
    nvme::OpenOptions open;
    open.create = create;
    open.direct = direct;
    fd_ = Value(nvme::OpenFile(path, open, &direct_));
    engine_ = Value(nvme::IoEngine::Create(set_.pointers(), engine_options));
    file_ = Value(engine_->AddFile(fd_, path, direct_));
    path_ = path;
  }
  ~PyIoFile() { Close(); }

  void Read(const py::object& buffer, uint64_t offset) { Transfer(buffer, offset, false); }
  void Write(const py::object& buffer, uint64_t offset) { Transfer(buffer, offset, true); }

  void Sync() {
    Require();
    Status status;
    {
      py::gil_scoped_release release;
      status = engine_->Sync(file_);
    }
    Check(status);
  }

  // Registers the buffers (io_uring fixed buffers); they must stay alive and unmoved until
  // register_buffers([]) or close().
  void RegisterBuffers(const std::vector<py::object>& buffers) {
    Require();
    std::vector<iovec> regions;
    std::vector<py::object> keep;
    for (const py::object& b : buffers) {
      Memory m = MemoryOf(b);
      regions.push_back(iovec{const_cast<void*>(m.data), m.bytes});
      keep.push_back(m.keep);
    }
    Check(engine_->RegisterBuffers(regions));
    registered_ = std::move(keep);
  }

  py::dict Info() const {
    Require();
    py::dict out;
    const nvme::Capabilities& caps = engine_->backend()->capabilities();
    out["path"] = path_;
    out["backend"] = caps.name;
    out["backends"] = engine_->backend_count();
    out["threads"] = engine_->threads();
    out["direct"] = direct_;
    out["alignment"] = nvme::DirectIoAlignment(fd_, direct_);
    out["registered_buffers"] = caps.registered_buffers;
    out["registered_files"] = caps.registered_files;
    out["sqpoll"] = caps.sqpoll;
    out["note"] = set_.note;
    return out;
  }

  py::dict Stats() const {
    Require();
    const nvme::IoStats s = engine_->stats();
    py::dict out;
    out["read_bytes"] = s.read_bytes;
    out["write_bytes"] = s.write_bytes;
    out["read_ops"] = s.read_ops;
    out["write_ops"] = s.write_ops;
    out["short_transfers"] = s.short_transfers;
    out["retries"] = s.retries;
    out["bounce_bytes"] = s.bounce_bytes;
    out["split_transfers"] = s.split_transfers;
    out["registered_ops"] = s.registered_ops;
    return out;
  }

  void Close() {
    if (!engine_) return;
    Status status = engine_->RemoveFile(file_);
    engine_.reset();
    set_.backends.clear();
    registered_.clear();
    ::close(fd_);
    fd_ = -1;
    Check(status);
  }

 private:
  void Require() const {
    if (!engine_) throw py::value_error("memplan: IoFile is closed");
  }
  void Transfer(const py::object& buffer, uint64_t offset, bool write) {
    Require();
    Memory m = MemoryOf(buffer);
    if (m.device) throw py::value_error("memplan: IoFile needs host memory");
    Status status;
    {
      py::gil_scoped_release release;
      status = write ? engine_->Write(file_, offset, m.data, m.bytes)
                     : engine_->Read(file_, offset, const_cast<void*>(m.data), m.bytes);
    }
    Check(status);
  }

  nvme::BackendSet set_;
  std::unique_ptr<nvme::IoEngine> engine_;  // destroyed before set_'s backends
  int fd_ = -1;
  int file_ = -1;
  bool direct_ = false;
  std::string path_;
  std::vector<py::object> registered_;
};

// memplan.CpuAdam: the CPU optimizer's Adam/AdamW step over caller arrays (numpy, torch CPU
// tensors), as the engine runs it on each sub-group; for benchmarks and numeric checks.
class PyCpuAdam {
 public:
  PyCpuAdam(int threads, const std::string& isa) {
    offload::CpuOptimizerOptions options;
    options.threads = threads;
    if (!isa.empty()) options.isa = Value(offload::ParseIsa(isa));
    cpu_ = Value(offload::CpuOptimizer::Create(options));
  }

  void Step(int64_t step, const py::object& params, const py::object& grads,
            const py::object& exp_avg, const py::object& exp_avg_sq, double lr, double beta1,
            double beta2, double eps, double weight_decay, bool decoupled, double grad_scale,
            const py::object& half_params, const std::string& half_dtype) {
    Memory p = Host(params, "params"), g = Host(grads, "grads"), m = Host(exp_avg, "exp_avg"),
           v = Host(exp_avg_sq, "exp_avg_sq");
    for (const Memory* f : {&p, &m, &v}) {
      if (f->dtype != "fp32") throw py::value_error("memplan: CpuAdam: fp32 arrays expected");
    }
    const size_t n = p.bytes / 4;
    offload::AdamOptions options;
    options.lr = lr;
    options.beta1 = beta1;
    options.beta2 = beta2;
    options.eps = eps;
    options.weight_decay = weight_decay;
    options.decoupled = decoupled;
    options.grad_scale = grad_scale;
    offload::AdamTensors t;
    t.params = {static_cast<float*>(const_cast<void*>(p.data)), n};
    if (g.dtype == "fp32") {
      t.grads = {static_cast<const float*>(g.data), g.bytes / 4};
    } else {
      // bf16 / fp16 gradients: the fused kernel widens them as it loads them.
      t.half_grads = {static_cast<const uint16_t*>(g.data), g.bytes / 2};
      t.grad_dtype = HalfOf(g.dtype);
    }
    t.exp_avg = {static_cast<float*>(const_cast<void*>(m.data)), m.bytes / 4};
    t.exp_avg_sq = {static_cast<float*>(const_cast<void*>(v.data)), v.bytes / 4};
    if (!half_params.is_none()) {
      Memory h = Host(half_params, "half_params");
      t.half_params = {static_cast<uint16_t*>(const_cast<void*>(h.data)), h.bytes / 2};
      t.half_dtype = HalfOf(half_dtype.empty() ? h.dtype : half_dtype);
    }
    Status status;
    {
      py::gil_scoped_release release;
      status = cpu_->AdamStep(options, step, t);
    }
    Check(status);
  }

  std::string Isa() const { return std::string(offload::IsaName(cpu_->isa())); }
  int Threads() const { return cpu_->threads(); }

 private:
  static Memory Host(const py::object& obj, const char* what) {
    Memory m = MemoryOf(obj);
    if (m.device) throw py::value_error(std::string("memplan: CpuAdam: ") + what + " on a GPU");
    return m;
  }
  static offload::HalfDtype HalfOf(const std::string& name) {
    if (name == "bf16") return offload::HalfDtype::kBf16;
    if (name == "fp16") return offload::HalfDtype::kFp16;
    throw py::value_error("memplan: 16-bit type " + name + " is not bf16 or fp16");
  }

  std::unique_ptr<offload::CpuOptimizer> cpu_;
};

}  // namespace
}  // namespace memplan::python

PYBIND11_MODULE(_native, m) {
  using memplan::python::PyCpuAdam;
  using memplan::python::PyEngine;
  using memplan::python::PyIoFile;
  m.doc() = "memplan's native extension; use the memplan package instead";
  m.attr("__version__") = MEMPLAN_VERSION;
  m.def(
      "estimate_json",
      [](const std::string& request) {
        return memplan::python::Answer(request, "estimate request", memplan::integration::Estimate);
      },
      py::arg("request"), "Estimate request JSON -> `memplan estimate --format json` JSON");
  m.def(
      "plan_json",
      [](const std::string& request) {
        return memplan::python::Answer(request, "plan request", memplan::integration::Plan);
      },
      py::arg("request"), "Plan request JSON -> `memplan plan --format json` JSON");
  m.def(
      "capacity_json",
      [](const std::string& request) {
        return memplan::python::Answer(request, "capacity request", memplan::integration::Capacity);
      },
      py::arg("request"), "Capacity request JSON -> `memplan capacity --format json` JSON");

  m.def(
      "nccl_unique_id",
      []() {
        auto id = memplan::offload::NcclUniqueId();
        if (!id.ok()) memplan::python::Raise(id.status());
        return py::bytes(*id);
      },
      "A new ncclUniqueId (128 bytes) for rank 0 to share; NotImplementedError without NCCL");

  py::class_<PyEngine>(m, "Engine")
      .def(py::init<const std::string&, const std::string&, const py::object&>(),
           py::arg("schedule_json"), py::arg("options_json") = "",
           py::arg("collective") = py::none())
      .def("add_parameter", &PyEngine::AddParameter, py::arg("name"), py::arg("module"),
           py::arg("shape"), py::arg("init") = py::none(),
           py::arg("also_used_by") = std::vector<std::string>(), py::arg("frozen") = false,
           py::arg("group") = 0, py::arg("dtype") = "")
      .def("start", &PyEngine::Start)
      .def("fetch", &PyEngine::Fetch, py::arg("module"))
      .def("release", &PyEngine::Release, py::arg("module"), py::arg("stream") = 0)
      .def("device_pointer", &PyEngine::DevicePointer, py::arg("param"))
      .def("host_view", &PyEngine::HostView, py::arg("param"), py::arg("numel"))
      .def("grad_ready", &PyEngine::GradReady, py::arg("param"), py::arg("grad"),
           py::arg("dtype") = "", py::arg("stream") = 0)
      .def("no_gradient", &PyEngine::NoGradient, py::arg("param"))
      .def_property_readonly("gradient_stream", &PyEngine::GradientStream)
      .def_property_readonly("device", &PyEngine::Device)
      .def("step", &PyEngine::Step, py::arg("options_json") = "")
      .def("prepare_step", &PyEngine::PrepareStep, py::arg("options_json") = "")
      .def("read_master", &PyEngine::ReadMaster, py::arg("param"), py::arg("out"))
      .def("gradient_norm", &PyEngine::GradientNorm, py::arg("norm_type") = 2.0,
           py::arg("grad_scale") = 1.0)
      .def("abandon_step", &PyEngine::AbandonStep)
      .def("shard", &PyEngine::Shard, py::arg("param"))
      .def_property_readonly("optimizer_states", &PyEngine::OptimizerStates)
      .def("read_state", &PyEngine::ReadState, py::arg("param"), py::arg("array"), py::arg("out"))
      .def("param_step", &PyEngine::ParamStep, py::arg("param"))
      .def("load_state", &PyEngine::LoadState, py::arg("fill"), py::arg("arrays"),
           py::arg("steps") = std::vector<uint64_t>())
      .def("stats_json", &PyEngine::StatsJson)
      .def_property_readonly("param_dtype", &PyEngine::ParamDtype)
      .def_property_readonly("runtime", &PyEngine::Runtime)
      .def("close", &PyEngine::Close);

  py::class_<PyIoFile>(m, "IoFile")
      .def(py::init<const std::string&, const std::string&, uint32_t, uint32_t, uint32_t, bool,
                    bool, bool, bool, uint32_t>(),
           py::arg("path"), py::arg("backend") = "auto", py::arg("block_size") = 1u << 20,
           py::arg("queue_depth") = 32u, py::arg("threads") = 1u, py::arg("direct") = true,
           py::arg("create") = false, py::arg("sqpoll") = false, py::arg("fixed_files") = true,
           py::arg("submit_batch") = 0u)
      .def("read", &PyIoFile::Read, py::arg("buffer"), py::arg("offset") = 0)
      .def("write", &PyIoFile::Write, py::arg("buffer"), py::arg("offset") = 0)
      .def("sync", &PyIoFile::Sync)
      .def("register_buffers", &PyIoFile::RegisterBuffers, py::arg("buffers"))
      .def("info", &PyIoFile::Info)
      .def("stats", &PyIoFile::Stats)
      .def("close", &PyIoFile::Close);

  py::class_<PyCpuAdam>(m, "CpuAdam")
      .def(py::init<int, const std::string&>(), py::arg("threads") = 1, py::arg("isa") = "")
      .def("step", &PyCpuAdam::Step, py::arg("step"), py::arg("params"), py::arg("grads"),
           py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("lr") = 1e-3, py::arg("beta1") = 0.9,
           py::arg("beta2") = 0.999, py::arg("eps") = 1e-8, py::arg("weight_decay") = 0.01,
           py::arg("decoupled") = true, py::arg("grad_scale") = 1.0,
           py::arg("half_params") = py::none(), py::arg("half_dtype") = "")
      .def_property_readonly("isa", &PyCpuAdam::Isa)
      .def_property_readonly("threads", &PyCpuAdam::Threads);
}
