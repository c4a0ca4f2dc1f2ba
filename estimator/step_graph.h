// The symbolic autograd the step model runs on (Note [The step model] in step_model.h): tensors
// that are sizes and dtypes only, the caching allocator's live bytes per category and phase,
// PyTorch's ops with what each saves for backward and allocates in it, autocast's casts, and
// a backward that runs the recorded nodes in reverse. Internal to the estimator: step_model.cc
// (the training loop, losses and optimizers) and step_blocks.h's ModelRun (the frameworks' blocks)
// use it.
//
// Thread safety: one Graph per simulation; no shared state.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "estimator/step_allocator.h"
#include "estimator/step_model.h"

namespace memplan::estimator::step {

__extension__ typedef unsigned __int128 Wide;

enum class DT : uint8_t { kF32, kBF16, kF16, kI64, kI32, kBool, kU8, kI8, kU64 };
int Bytes(DT dt);
inline bool Half(DT dt) { return dt == DT::kBF16 || dt == DT::kF16; }

// A tensor: an index into Graph's tensors. -1 is "none".
struct T {
  int id = -1;
  bool ok() const { return id >= 0; }
};

class Graph {
 public:
  Graph();
  // Room for about `params` parameters and the tensors, buffers and nodes a step makes over them,
  // so that a model of tens of thousands of tensors is not copied while it grows.
  void Reserve(size_t params) {
    params_.reserve(params);
    tensors_.reserve(4 * params);
    bufs_.reserve(2 * params);
    nodes_.reserve(2 * params);
    alloc_log_.reserve(16 * params);
  }

  // --- Memory ---------------------------------------------------------------------------------
  // A buffer of `bytes` (rounded as the caching allocator rounds) in category `c`, with one
  // reference.
  int Alloc(StepCategory c, Wide bytes);
  void Ref(int buf);
  void Unref(int buf);
  void Recategorize(int buf, StepCategory c);
  void SetPhase(StepPhase p) { phase_ = p; }
  StepPhase phase() const { return phase_; }
  void SetWhere(std::string where) { where_ = std::move(where); }
  const std::array<StepPhasePeak, kStepPhases>& peaks() const { return peaks_; }
  Wide live() const { return total_; }
  Wide live(StepCategory c) const { return cur_[static_cast<int>(c)]; }
  bool overflow() const { return overflow_; }

  // --- Tensors --------------------------------------------------------------------------------
  // A new tensor of `numel` elements made by an op (category: activations in forward,
  // temporaries in backward, unless given).
  T New(Wide numel, DT dt, bool requires_grad);
  T NewIn(StepCategory c, Wide numel, DT dt, bool requires_grad);
  // A leaf parameter that exists already (its bytes are the memory model's): no buffer here.
  // `uses` is counted by the ops that read it.
  T Param(Wide numel, DT dt, bool trainable);
  // A tensor standing for memory outside the step (the batch): referenced, never freed.
  T External(Wide numel, DT dt);
  // Another reference to the same tensor (its gradient is the tensor's), or with `view` a view
  // of its storage: a tensor of its own whose gradient a view node passes on.
  T Alias(T t, Wide numel = 0, bool view = false);
  void Drop(T t);  // the Python variable holding `t` goes
  Wide Numel(T t) const { return tensors_[t.id].numel; }
  DT Dtype(T t) const { return tensors_[t.id].dt; }
  bool RequiresGrad(T t) const { return t.ok() && tensors_[t.id].rg; }
  void SetRequiresGrad(T t, bool rg) { tensors_[t.id].rg = rg; }

  // --- Autograd -------------------------------------------------------------------------------
  // A node: consumes the gradients of `outputs`, produces gradients for the inputs that require
  // them (allocated as the input's numel and dtype), keeps `saved` until it has run, and
  // allocates `extra` temporaries (numel, dtype) while it runs. A param input's gradient goes to
  // AccumulateGrad.
  struct NodeSpec {
    const char* name = "";
    std::vector<T> inputs;
    std::vector<T> outputs;
    std::vector<T> saved;
    std::vector<std::pair<Wide, DT>> extra;
    // Gradients of these inputs are views of the output's gradient (no allocation): reshapes,
    // transposes, additions.
    std::vector<bool> passthrough;
    // Extra temporaries that stay until the node's input gradients are produced, then go
    // (flash attention's dQ accumulator); allocated before the input gradients.
    bool extra_before_grads = true;
    // Scratch the node's backward makes and frees before anything else it allocates: all of it
    // live at once at its peak (torchao's NF4 dequantization, whose locals live until it
    // returns the weight).
    std::vector<std::pair<Wide, DT>> scratch;
  };
  void Record(NodeSpec spec);
  // Record(Spec(...)) without designated initialisers.
  static NodeSpec Spec(const char* name, std::vector<T> inputs, std::vector<T> outputs,
                       std::vector<T> saved = {}, std::vector<bool> passthrough = {}) {
    NodeSpec n;
    n.name = name;
    n.inputs = std::move(inputs);
    n.outputs = std::move(outputs);
    n.saved = std::move(saved);
    n.passthrough = std::move(passthrough);
    return n;
  }
  // Saving on/off (a checkpointed forward saves nothing; its checkpoint node re-runs it). Off
  // starts a checkpointed region: the nodes it records are kept only while they form a tail that
  // saves nothing (Note [What runs before the recompute] in step_graph.cc).
  void SetSaving(bool on) {
    saving_ = on;
    if (!on) ck_tail_.clear();
  }
  bool saving() const { return saving_; }
  // A checkpointed region: `run` re-runs the region's forward from `input`, returning its output.
  // `held` are the other tensors the checkpointed call was given (rotary tables, masks): the
  // checkpoint keeps them until its backward.
  // Selective checkpointing (torchtitan's per-op policy): `cached` are the outputs the policy
  // saved in the forward, kept until the recompute has taken them (ReuseNext); `early_stop`
  // off re-runs the whole region (its allocations all count).
  void RecordCheckpoint(T input, T output, std::function<T(T)> rerun,
                        const std::vector<T>& held = {}, const std::vector<T>& cached = {},
                        bool early_stop = true);
  // The next tensors made (New, NewIn), in order, are these, not new allocations: what a
  // selective checkpoint's recompute takes from its cache instead of running the op.
  void ReuseNext(std::vector<T> cached) { reuse_ = std::move(cached); }
  // Ops of a checkpointed block's own forward, outside its submodules: what they make in the
  // recompute is a temporary (Note [The recompute's own ops] in step_graph.cc).
  void SetBlockBody(bool on) { block_body_ = on; }

  // Starts backward from `root` (a scalar loss that requires grad): its gradient is a new
  // 1-element tensor; nodes run in reverse order of recording.
  void Backward(T root);
  // A backward inside the forward (torchtitan's chunked loss): runs the nodes recorded since
  // `first` (NodeCount() then) from `root`, and forgets them; earlier nodes stay.
  size_t NodeCount() const { return nodes_.size(); }
  void BackwardTail(T root, size_t first);
  bool in_backward() const { return in_backward_; }
  // A hook that backward runs when it reaches this point of the recording (FSDP2's pre- and
  // post-backward hooks: recorded after a module's forward, it runs before the module's
  // backward; recorded before, after it).
  void RecordHook(std::function<void()> hook);
  // The gradient `t` has received (a trainable parameter's .grad once every use has given its
  // part), handed to the caller with its reference: the tensor no longer holds it. -1 when
  // there is none. `graph_local`: the uses recorded in other graphs (a weight tied across a
  // detach, as torchtitan's chunked loss detaches the hidden states) do not hold it back.
  int TakeGrad(T t, bool graph_local = false);
  // Gives `t` the storage of `grad` as its gradient (one more reference), as a custom autograd
  // function returns a gradient it holds.
  void SetGrad(T t, T grad);

  // --- Autocast -------------------------------------------------------------------------------
  // The autocast weight-cast cache: a trainable leaf cast to `dt` once per autocast region. A
  // view of the parameter (`view`: FalconLinear's weight.T) is no leaf, and is cast anew each time.
  void SetAutocast(bool on, DT dt) {
    autocast_ = on;
    autocast_dt_ = dt;
  }
  bool autocast() const { return autocast_; }
  DT autocast_dtype() const { return autocast_dt_; }
  T CastWeight(T param, DT dt, bool view = false);
  // A non-parameter leaf that requires grad (the frozen embedding's output made to require it):
  // autocast's cached_cast caches its casts as it does a weight's. Leaf(x) is the marked leaf x
  // refers to, for CastWeight, or none.
  void MarkLeaf(T t) { leaves_.insert(Root(t.id)); }
  T Leaf(T x) const {
    const int root = Root(x.id);
    return leaves_.count(root) > 0 && tensors_[static_cast<size_t>(x.id)].rg ? T{root} : T{};
  }
  void ClearAutocastCache();

  // FSDPMemTracker counts a parameter's unsharded gradient as a temporary until its unit's
  // post-backward names it (the caller recategorizes it then).
  void SetGradsAsTemporaries(bool on) { grads_as_temporaries_ = on; }
  // The gradients exist before backward (Note [Gradients that persist]): a parameter's complete
  // gradient is added into them in place and its buffer freed.
  void SetGradsInPlace(bool on) { grads_in_place_ = on; }

  // Every allocation and free so far, in order, as the caching allocator would see them (Note
  // [The caching allocator's reserve]); what a recompute makes past its early stop has id -1.
  const std::vector<AllocatorEvent>& AllocatorLog() const { return alloc_log_; }
  // The CUDA stream the allocations from here on are made on (0: the default stream); FSDP2's
  // collectives allocate on their own.
  void SetStream(int stream) { stream_ = stream; }

  // Gradients produced for trainable parameters so far (bytes in the gradients category).
  int ParamGradBuffer(T param) const { return params_.at(tensors_[param.id].param).grad; }

 private:
  struct Buf {
    Wide bytes = 0;
    StepCategory cat = StepCategory::kActivations;
    int refs = 0;
    // Made by a recompute past the point where torch stops it: never allocated on the GPU
    // (Note [The recompute stops at the last saved tensor]).
    bool phantom = false;
  };
  struct Tensor {
    Wide numel = 0;
    DT dt = DT::kF32;
    int buf = -1;
    bool rg = false;
    int param = -1;  // index into params_
    int grad = -1;   // the gradient in flight (a buffer), -1 none
    int same = -1;   // another reference to this tensor: its gradient slot is that one's
  };
  // The tensor whose gradient slot `id` uses.
  int Root(int id) const {
    while (tensors_[static_cast<size_t>(id)].same >= 0) id = tensors_[static_cast<size_t>(id)].same;
    return id;
  }
  struct ParamState {
    int uses = 0;      // nodes that will produce a gradient for it
    int arrived = 0;   // of those, already run
    int pending = -1;  // the engine's input buffer: the gradient so far
    int grad = -1;     // .grad once all arrived
    bool trainable = false;
    Wide numel = 0;
    DT dt = DT::kF32;
  };
  struct Node {
    NodeSpec spec;
    std::vector<int> saved_bufs;
    std::function<T(T)> rerun;     // a checkpoint
    std::function<void()> hook;    // RecordHook's
    std::vector<int> cached_bufs;  // a selective checkpoint's saved outputs
    bool ck_early_stop = true;
    T ck_input, ck_output;
    std::string ck_where;  // where the checkpointed block ran ("layer 3"): its recompute's peak
    // A checkpoint's last nodes, as its forward recorded them, that save no tensor: backward runs
    // them before the recompute (Note [What runs before the recompute]).
    std::vector<Node> tail;
  };

  // Note [The recompute stops at the last saved tensor]: while a checkpoint re-runs a block,
  // the allocations wait here, with the Records that save, until the run ends and the point
  // where torch stopped it is known; those up to it count toward the peaks.
  struct AllocEvent {
    int buf = -1;
    Wide total = 0;
    std::array<Wide, kStepCategories> cur{};
  };
  struct SaveMark {
    size_t events = 0;          // allocations made before the Record
    bool saves_output = false;  // it saves one of its own outputs (packed after the op runs)
    std::vector<int> output_bufs;
  };
  void TrackAt(Wide total, const std::array<Wide, kStepCategories>& cur);
  void ReplayRecompute();
  bool deferring_ = false;
  std::vector<T> reuse_;          // ReuseNext's
  std::vector<int> reuse_taken_;  // cache entries handed to the recompute (their references)
  std::vector<AllocEvent> deferred_;
  std::vector<SaveMark> marks_;

  void Accumulate(T input, int grad_buf);
  void RunNode(Node& node);
  void ReleaseNode(Node& node);  // drops its output gradients and saved tensors
  void RunRange(size_t begin, size_t end);
  void Track();

  std::vector<Buf> bufs_;
  std::vector<Tensor> tensors_;
  std::vector<ParamState> params_;
  std::vector<Node> nodes_;
  std::vector<Node> ck_tail_;    // the checkpointed region's nodes since its last saving one
  std::map<int, T> cast_cache_;  // param (or leaf root) tensor id -> cast
  std::set<int> leaves_;         // MarkLeaf's, by root tensor id
  std::array<Wide, kStepCategories> cur_{};
  Wide total_ = 0;
  StepPhase phase_ = StepPhase::kForward;
  std::string where_;
  std::array<StepPhasePeak, kStepPhases> peaks_{};
  std::array<Wide, kStepPhases> peak_wide_{};
  bool saving_ = true;
  bool grads_as_temporaries_ = false;
  bool grads_in_place_ = false;
  std::vector<AllocatorEvent> alloc_log_;
  size_t recompute_log_start_ = 0;  // alloc_log_'s size when the recompute being deferred began
  int stream_ = 0;
  bool autocast_ = false;
  DT autocast_dt_ = DT::kBF16;
  bool in_backward_ = false;
  bool recomputing_ = false;
  bool block_body_ = false;
  bool overflow_ = false;
  bool stale_ = false;  // a freed buffer was referenced again (a modelling error)
 public:
  bool stale() const { return stale_; }
};

}  // namespace memplan::estimator::step
