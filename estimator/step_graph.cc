#include "estimator/step_graph.h"

#include <algorithm>
#include <limits>
#include <string_view>

namespace memplan::estimator::step {

int Bytes(DT dt) {
  switch (dt) {
    case DT::kF32:
    case DT::kI32: return 4;
    case DT::kBF16:
    case DT::kF16: return 2;
    case DT::kI64:
    case DT::kU64: return 8;
    case DT::kBool:
    case DT::kU8:
    case DT::kI8: return 1;
  }
  return 4;
}

Graph::Graph() = default;

namespace {

constexpr Wide kMaxBytes = Wide{1} << 62;

Wide Round(Wide bytes) {
  if (bytes == 0) return 0;
  return std::max<Wide>(512, (bytes + 511) / 512 * 512);
}

uint64_t Narrow(Wide v) {
  return v > static_cast<Wide>(std::numeric_limits<uint64_t>::max())
             ? std::numeric_limits<uint64_t>::max()
             : static_cast<uint64_t>(v);
}

}  // namespace

int Graph::Alloc(StepCategory c, Wide bytes) {
  Buf b;
  b.bytes = Round(bytes);
  if (b.bytes > kMaxBytes) {
    overflow_ = true;
    b.bytes = 0;
  }
  b.cat = c;
  b.refs = 1;
  bufs_.push_back(b);
  alloc_log_.push_back({static_cast<int>(bufs_.size()) - 1, true, Narrow(b.bytes), stream_});
  cur_[static_cast<int>(c)] += b.bytes;
  total_ += b.bytes;
  if (total_ > kMaxBytes) overflow_ = true;
  if (deferring_) {
    AllocEvent e;
    e.buf = static_cast<int>(bufs_.size()) - 1;
    e.total = total_;
    e.cur = cur_;
    deferred_.push_back(e);
    return e.buf;
  }
  Track();
  return static_cast<int>(bufs_.size()) - 1;
}

void Graph::Ref(int buf) {
  if (buf < 0) return;
  Buf& b = bufs_[static_cast<size_t>(buf)];
  if (b.refs == 0) {
    // A reference to freed memory is a modelling error; count the memory again rather than
    // let the totals wrap.
    cur_[static_cast<int>(b.cat)] += b.bytes;
    total_ += b.bytes;
    stale_ = true;
    alloc_log_.push_back({buf, true, Narrow(b.bytes), 0});
  }
  ++b.refs;
}

void Graph::Unref(int buf) {
  if (buf < 0) return;
  Buf& b = bufs_[static_cast<size_t>(buf)];
  if (b.refs <= 0) return;
  if (--b.refs == 0) {
    cur_[static_cast<int>(b.cat)] -= b.bytes;
    total_ -= b.bytes;
    if (!b.phantom) alloc_log_.push_back({buf, false, 0, 0});
  }
}

void Graph::Recategorize(int buf, StepCategory c) {
  if (buf < 0) return;
  Buf& b = bufs_[static_cast<size_t>(buf)];
  if (b.refs > 0) {
    cur_[static_cast<int>(b.cat)] -= b.bytes;
    cur_[static_cast<int>(c)] += b.bytes;
  }
  b.cat = c;
}

void Graph::Track() { TrackAt(total_, cur_); }

void Graph::TrackAt(Wide total, const std::array<Wide, kStepCategories>& cur) {
  const int p = static_cast<int>(phase_);
  if (total <= peak_wide_[static_cast<size_t>(p)] && peaks_[static_cast<size_t>(p)].bytes != 0) {
    return;
  }
  peak_wide_[static_cast<size_t>(p)] = total;
  StepPhasePeak& peak = peaks_[static_cast<size_t>(p)];
  peak.bytes = Narrow(total);
  for (int c = 0; c < kStepCategories; ++c) {
    peak.categories[static_cast<size_t>(c)] = Narrow(cur[static_cast<size_t>(c)]);
  }
  peak.where = where_;
}

// Note [The recompute stops at the last saved tensor]
// torch.utils.checkpoint (use_reentrant=False) stops the recompute as soon as the last tensor the
// block's forward saved has been saved again (early stop, on by default: it raises out of the
// re-run forward). An op saves its inputs before it runs (the generated autograd kernels make
// the SavedVariables, then call the op) and its outputs after, so when the last saving op
// saves only inputs (the last Linear's, LoRA's lora_B's input) its output is never made, and
// nothing after it runs: the down projection's output, LoRA's scaling and sum, the residual
// add. The graph runs the whole block (its Python shape is simpler so), holding back the
// peaks of what the re-run allocates, and counts them only up to that point.
void Graph::ReplayRecompute() {
  // The last Record that saved: everything the re-run allocated before it counts, but its own
  // outputs only when it saves one of them.
  size_t cut = deferred_.size();
  std::vector<int> skip;
  if (!marks_.empty()) {
    cut = marks_.back().events;
    if (!marks_.back().saves_output) skip = marks_.back().output_bufs;
  }
  bool any_phantom = false;
  for (size_t i = 0; i < deferred_.size(); ++i) {
    const AllocEvent& e = deferred_[i];
    if (i >= cut || std::find(skip.begin(), skip.end(), e.buf) != skip.end()) {
      if (e.buf >= 0) bufs_[static_cast<size_t>(e.buf)].phantom = true;
      any_phantom = true;
      continue;
    }
    TrackAt(e.total, e.cur);
  }
  if (any_phantom) {
    for (size_t i = recompute_log_start_; i < alloc_log_.size(); ++i) {
      AllocatorEvent& e = alloc_log_[i];
      if (e.id >= 0 && bufs_[static_cast<size_t>(e.id)].phantom) e.id = -1;
    }
  }
  deferred_.clear();
  marks_.clear();
}

T Graph::NewIn(StepCategory c, Wide numel, DT dt, bool requires_grad) {
  Tensor t;
  t.numel = numel;
  t.dt = dt;
  t.rg = requires_grad;
  if (!reuse_.empty()) {
    const Tensor& from = tensors_[static_cast<size_t>(reuse_.front().id)];
    reuse_.erase(reuse_.begin());
    if (from.buf >= 0 &&
        Round(numel * static_cast<Wide>(Bytes(dt))) == bufs_[static_cast<size_t>(from.buf)].bytes) {
      // The cache lets the entry go as it hands it over: its reference is the new tensor's.
      t.buf = from.buf;
      reuse_taken_.push_back(t.buf);
      tensors_.push_back(t);
      return T{static_cast<int>(tensors_.size()) - 1};
    }
    stale_ = true;  // the cache holds another tensor than the op makes: a modelling error
  }
  t.buf = Alloc(c, numel * static_cast<Wide>(Bytes(dt)));
  tensors_.push_back(t);
  return T{static_cast<int>(tensors_.size()) - 1};
}

T Graph::New(Wide numel, DT dt, bool requires_grad) {
  const bool temporary = in_backward_ || (recomputing_ && block_body_);
  return NewIn(temporary ? StepCategory::kTemporaries : StepCategory::kActivations, numel, dt,
               requires_grad);
}

T Graph::Param(Wide numel, DT dt, bool trainable) {
  ParamState p;
  p.trainable = trainable;
  p.numel = numel;
  p.dt = dt;
  params_.push_back(p);
  Tensor t;
  t.numel = numel;
  t.dt = dt;
  t.rg = trainable;
  t.param = static_cast<int>(params_.size()) - 1;
  tensors_.push_back(t);
  return T{static_cast<int>(tensors_.size()) - 1};
}

T Graph::External(Wide numel, DT dt) {
  Tensor t;
  t.numel = numel;
  t.dt = dt;
  tensors_.push_back(t);
  return T{static_cast<int>(tensors_.size()) - 1};
}

T Graph::Alias(T t, Wide numel, bool view) {
  Tensor a = tensors_[static_cast<size_t>(t.id)];
  a.grad = -1;
  if (numel != 0) a.numel = numel;
  if (!view) {
    a.same = Root(t.id);
  } else {
    a.param = -1;
    a.same = -1;
  }
  Ref(a.buf);
  tensors_.push_back(a);
  return T{static_cast<int>(tensors_.size()) - 1};
}

void Graph::Drop(T t) {
  if (!t.ok()) return;
  Tensor& x = tensors_[static_cast<size_t>(t.id)];
  if (x.buf >= 0 && x.param < 0) Unref(x.buf);
}

void Graph::Record(NodeSpec spec) {
  if (!saving_) {
    // A checkpointed forward: the node is kept (without its saved tensors) while the region's
    // nodes since the last one that saves a tensor or takes a trainable parameter all save none.
    bool ends_tail = std::any_of(spec.saved.begin(), spec.saved.end(), [](T t) { return t.ok(); });
    for (const T& in : spec.inputs) {
      if (in.ok() && tensors_[static_cast<size_t>(in.id)].param >= 0 && RequiresGrad(in)) {
        ends_tail = true;
      }
    }
    if (ends_tail) {
      ck_tail_.clear();
    } else {
      Node node;
      spec.saved.clear();
      node.spec = std::move(spec);
      ck_tail_.push_back(std::move(node));
    }
    return;
  }
  Node node;
  if (deferring_ && std::any_of(spec.saved.begin(), spec.saved.end(), [](T t) { return t.ok(); })) {
    SaveMark m;
    m.events = deferred_.size();
    for (const T& o : spec.outputs) {
      if (!o.ok()) continue;
      const int buf = tensors_[static_cast<size_t>(o.id)].buf;
      m.output_bufs.push_back(buf);
      for (const T& sv : spec.saved) {
        if (sv.ok() && tensors_[static_cast<size_t>(sv.id)].buf == buf && buf >= 0) {
          m.saves_output = true;
        }
      }
    }
    marks_.push_back(std::move(m));
  }
  for (const T& s : spec.saved) {
    if (!s.ok()) continue;
    const Tensor& x = tensors_[static_cast<size_t>(s.id)];
    if (x.buf >= 0 && x.param < 0) {
      Ref(x.buf);
      node.saved_bufs.push_back(x.buf);
    }
  }
  for (const T& in : spec.inputs) {
    if (!in.ok()) continue;
    const Tensor& x = tensors_[static_cast<size_t>(in.id)];
    if (x.param >= 0 && x.rg) ++params_[static_cast<size_t>(x.param)].uses;
  }
  spec.saved.clear();
  node.spec = std::move(spec);
  nodes_.push_back(std::move(node));
}

void Graph::RecordCheckpoint(T input, T output, std::function<T(T)> rerun,
                             const std::vector<T>& held, const std::vector<T>& cached,
                             bool early_stop) {
  Node node;
  node.ck_early_stop = early_stop;
  for (T t : cached) {
    const int b = tensors_[static_cast<size_t>(t.id)].buf;
    if (b < 0) continue;
    Ref(b);
    node.cached_bufs.push_back(b);
  }
  node.spec.name = "checkpoint";
  node.spec.outputs = {output};
  node.ck_input = input;
  node.ck_output = output;
  node.rerun = std::move(rerun);
  node.ck_where = where_;
  // The tail counts only if it ends in the region's output.
  const int out_root = Root(output.id);
  if (!ck_tail_.empty() &&
      std::any_of(ck_tail_.back().spec.outputs.begin(), ck_tail_.back().spec.outputs.end(),
                  [&](T o) { return o.ok() && Root(o.id) == out_root; })) {
    node.tail = std::move(ck_tail_);
  }
  ck_tail_.clear();
  for (T t : held) {
    if (!t.ok()) continue;
    const Tensor& h = tensors_[static_cast<size_t>(t.id)];
    if (h.buf >= 0 && h.param < 0) {
      Ref(h.buf);
      node.saved_bufs.push_back(h.buf);
    }
  }
  const Tensor& x = tensors_[static_cast<size_t>(input.id)];
  if (x.buf >= 0) {
    Ref(x.buf);
    node.saved_bufs.push_back(x.buf);
  }
  nodes_.push_back(std::move(node));
}

void Graph::Accumulate(T input, int grad_buf) {
  Tensor& x = tensors_[static_cast<size_t>(Root(input.id))];
  if (x.param >= 0) {
    ParamState& p = params_[static_cast<size_t>(x.param)];
    ++p.arrived;
    if (p.pending < 0) {
      p.pending = grad_buf;
    } else {
      // The engine's InputBuffer adds a second gradient out of place.
      const int sum = Alloc(StepCategory::kTemporaries, p.numel * static_cast<Wide>(Bytes(p.dt)));
      Unref(p.pending);
      Unref(grad_buf);
      p.pending = sum;
    }
    if (p.arrived >= p.uses && grads_in_place_) {
      // Note [Gradients that persist]: added into the existing storage, the buffer freed.
      Unref(p.pending);
      p.pending = -1;
    } else if (p.arrived >= p.uses) {
      // AccumulateGrad steals the incoming gradient as .grad.
      if (!grads_as_temporaries_) Recategorize(p.pending, StepCategory::kGradients);
      p.grad = p.pending;
      p.pending = -1;
    }
    return;
  }
  if (x.grad < 0) {
    x.grad = grad_buf;
  } else {
    Unref(grad_buf);  // added in place
  }
}

// Note [The recompute's own ops]
// Transformers (>= 5, modeling_layers.GradientCheckpointingLayer) checkpoints a layer's plain
// forward function, not the module call, so the recompute runs no hooks of the layer itself, only
// of its submodules. torch's MemTracker counts what backward allocates as activations only
// between the pre- and post-forward hooks of a module run in backward (its `_in_ac`), so the
// layer's own ops in the recompute (its residual adds) make temporaries: the trace of Mistral
// with LoRA on every Linear and checkpointing has the first residual sum of layer 1's recompute
// (32 MiB) among its temporaries at the peak. The bytes are the same either way; the split is the
// tracker's. Blocks mark such ops with SetBlockBody.
//
// Note [What runs before the recompute]
// torch.utils.checkpoint with use_reentrant=False records the block's autograd nodes in the
// forward and swaps their saved tensors for handles; the first handle that backward unpacks
// re-runs the block's forward. The engine runs ready nodes latest-recorded first, so the block's
// last nodes that save no tensor (a residual add, the cast of the gradient to the output's dtype,
// LoRA's scaling of its path) run before the recompute, and the gradients they make are alive
// through it: with LoRA on every Linear of a Mistral block, 64 MiB of the 100 MiB of temporaries
// at the traced peak. The graph keeps those nodes from the checkpointed forward (Record with
// saving off: the nodes since the last one that saves a tensor) when they end in the block's
// output, runs them first, and passes their gradients to the recompute's tensors in the same
// places. A tail node that takes a trainable parameter ends the tail instead, so that its
// gradient counts in the parameter's uses once (the recompute's Record counts them).
void Graph::RunNode(Node& node) {
  if (node.hook) {
    node.hook();
    return;
  }
  bool any = false;
  for (const T& out : node.spec.outputs) {
    if (out.ok() && tensors_[static_cast<size_t>(Root(out.id))].grad >= 0) any = true;
  }
  if (any && node.rerun) {
    // Non-reentrant checkpoint: the nodes of the block's tail that save nothing, then the block's
    // forward again, saving, then the rest of its backward (Note [What runs before the
    // recompute]).
    SetWhere(node.ck_where + " recompute");
    const size_t k = node.tail.size();
    for (size_t i = k; i > 0; --i) RunNode(node.tail[i - 1]);
    const size_t begin = nodes_.size();
    const bool was = in_backward_, was_recomputing = recomputing_;
    in_backward_ = false;
    recomputing_ = true;
    const bool was_deferring = deferring_;
    if (!was_deferring) recompute_log_start_ = alloc_log_.size();
    deferring_ = true;
    T out2 = node.rerun(node.ck_input);
    deferring_ = was_deferring;
    if (!node.ck_early_stop) marks_.clear();  // the whole region re-ran
    if (!deferring_) ReplayRecompute();       // Note [The recompute stops at the last saved tensor]
    // The selective cache's entries were taken by the recompute: the nodes that save them hold
    // them now.
    for (int b : node.cached_bufs) {
      auto taken = std::find(reuse_taken_.begin(), reuse_taken_.end(), b);
      if (taken != reuse_taken_.end()) {
        reuse_taken_.erase(taken);
      } else {
        Unref(b);
      }
    }
    node.cached_bufs.clear();
    ClearAutocastCache();
    in_backward_ = was;
    recomputing_ = was_recomputing;
    const size_t end = nodes_.size();
    if (k == 0) {
      Tensor& o = tensors_[static_cast<size_t>(Root(node.ck_output.id))];
      tensors_[static_cast<size_t>(Root(out2.id))].grad = o.grad;
      o.grad = -1;
    } else if (end - begin < k) {
      stale_ = true;  // the recompute recorded other nodes than the forward: a modelling error
    } else {
      // The tail's gradients wait on the forward's tensors; the recompute's copies of the tail
      // (its last k nodes, which hold nothing) are dropped unrun, and the gradients move to the
      // recompute's tensors in the same places.
      for (size_t j = 0; j < k; ++j) {
        const NodeSpec& ran = node.tail[j].spec;
        const NodeSpec& copy = nodes_[end - k + j].spec;
        if (std::string_view(ran.name) != copy.name || ran.inputs.size() != copy.inputs.size()) {
          stale_ = true;
          continue;
        }
        for (size_t p = 0; p < ran.inputs.size(); ++p) {
          if (!ran.inputs[p].ok() || !copy.inputs[p].ok()) continue;
          Tensor& from = tensors_[static_cast<size_t>(Root(ran.inputs[p].id))];
          Tensor& to = tensors_[static_cast<size_t>(Root(copy.inputs[p].id))];
          if (&from == &to || from.grad < 0) continue;
          if (to.grad < 0) {
            to.grad = from.grad;
          } else {
            Unref(from.grad);  // added in place
          }
          from.grad = -1;
        }
      }
      for (size_t j = end - k; j < end; ++j) ReleaseNode(nodes_[j]);
      nodes_.resize(end - k);
    }
    Drop(out2);
    RunRange(begin, nodes_.size());
    nodes_.resize(begin);
  } else if (any) {
    const NodeSpec& s = node.spec;
    std::vector<int> extras;
    auto alloc_extras = [&] {
      for (const auto& [numel, dt] : s.extra) {
        extras.push_back(Alloc(StepCategory::kTemporaries, numel * static_cast<Wide>(Bytes(dt))));
      }
    };
    {
      std::vector<int> scratch;
      for (const auto& [numel, dt] : s.scratch) {
        scratch.push_back(Alloc(StepCategory::kTemporaries, numel * static_cast<Wide>(Bytes(dt))));
      }
      for (int b : scratch) Unref(b);
    }
    if (s.extra_before_grads) alloc_extras();
    int first_out_grad = -1;
    for (const T& out : s.outputs) {
      if (out.ok() && tensors_[static_cast<size_t>(Root(out.id))].grad >= 0) {
        first_out_grad = tensors_[static_cast<size_t>(Root(out.id))].grad;
        break;
      }
    }
    std::vector<std::pair<T, int>> grads;
    for (size_t i = 0; i < s.inputs.size(); ++i) {
      const T in = s.inputs[i];
      if (!RequiresGrad(in)) continue;
      const Tensor& x = tensors_[static_cast<size_t>(in.id)];
      int g;
      if (i < s.passthrough.size() && s.passthrough[i] && first_out_grad >= 0 && x.param < 0) {
        g = first_out_grad;
        Ref(g);
      } else {
        g = Alloc(StepCategory::kTemporaries, x.numel * static_cast<Wide>(Bytes(x.dt)));
      }
      grads.emplace_back(in, g);
    }
    if (!s.extra_before_grads) alloc_extras();
    for (int e : extras) Unref(e);
    // The engine (torch/csrc/autograd/engine.cpp evaluate_function) calls the node with its
    // input buffer moved in and releases the saved variables after it runs, so the incoming
    // gradient and the saved tensors are gone before the results are added into the next
    // nodes' input buffers, where a second gradient of the same tensor is summed.
    ReleaseNode(node);
    for (const auto& [in, g] : grads) Accumulate(in, g);
    return;
  }
  ReleaseNode(node);
}

void Graph::ReleaseNode(Node& node) {
  for (const T& out : node.spec.outputs) {
    if (!out.ok()) continue;
    Tensor& o = tensors_[static_cast<size_t>(Root(out.id))];
    if (o.grad >= 0) {
      Unref(o.grad);
      o.grad = -1;
    }
  }
  for (int b : node.saved_bufs) Unref(b);
  node.saved_bufs.clear();
  for (int b : node.cached_bufs) Unref(b);
  node.cached_bufs.clear();
}

void Graph::RunRange(size_t begin, size_t end) {
  for (size_t i = end; i > begin; --i) {
    // RunNode may append (a checkpoint's recompute) and reallocate nodes_: move it out first.
    Node node = std::move(nodes_[i - 1]);
    RunNode(node);
  }
}

void Graph::Backward(T root) {
  in_backward_ = true;
  Tensor& r = tensors_[static_cast<size_t>(Root(root.id))];
  // torch.autograd.backward's grad_tensors_ (_make_grads: ones_like(loss)) is made before the
  // engine runs, so the memory tracker counts it as an activation, and the Python frame holds it
  // until the engine returns.
  const int seed = Alloc(StepCategory::kActivations, static_cast<Wide>(Bytes(r.dt)));
  Ref(seed);
  r.grad = seed;
  RunRange(0, nodes_.size());
  Unref(seed);
  nodes_.clear();
  in_backward_ = false;
}

void Graph::BackwardTail(T root, size_t first) {
  const bool was = in_backward_;
  in_backward_ = true;
  Tensor& r = tensors_[static_cast<size_t>(Root(root.id))];
  const int seed = Alloc(StepCategory::kTemporaries, static_cast<Wide>(Bytes(r.dt)));
  Ref(seed);
  r.grad = seed;
  RunRange(first, nodes_.size());
  Unref(seed);
  nodes_.resize(first);
  in_backward_ = was;
}

void Graph::RecordHook(std::function<void()> hook) {
  Node node;
  node.spec.name = "hook";
  node.hook = std::move(hook);
  nodes_.push_back(std::move(node));
}

int Graph::TakeGrad(T t, bool graph_local) {
  Tensor& x = tensors_[static_cast<size_t>(Root(t.id))];
  if (x.param >= 0) {
    // Only a complete .grad: a tied weight's first gradient waits in the engine's input buffer.
    ParamState& p = params_[static_cast<size_t>(x.param)];
    int g = p.grad;
    p.grad = -1;
    if (g < 0 && graph_local) {
      g = p.pending;
      p.pending = -1;
      if (g >= 0) Recategorize(g, StepCategory::kGradients);
    }
    return g;
  }
  const int g = x.grad;
  x.grad = -1;
  return g;
}

void Graph::SetGrad(T t, T grad) {
  Tensor& x = tensors_[static_cast<size_t>(Root(t.id))];
  const int buf = tensors_[static_cast<size_t>(grad.id)].buf;
  Ref(buf);
  if (x.grad >= 0) Unref(x.grad);
  x.grad = buf;
}

T Graph::CastWeight(T param, DT dt, bool view) {
  const Tensor& p = tensors_[static_cast<size_t>(param.id)];
  if (p.dt == dt) return param;
  const bool cacheable = p.rg && !view;  // cached_cast: leaves that require grad only
  if (cacheable) {
    auto it = cast_cache_.find(param.id);
    if (it != cast_cache_.end()) {
      // The same tensor again (its gradient slot shared): one more reference for the caller.
      Ref(tensors_[static_cast<size_t>(it->second.id)].buf);
      return it->second;
    }
  }
  T c = New(p.numel, dt, p.rg);
  Record(Graph::Spec("ToCopy(weight)", {param}, {c}));
  if (cacheable) {
    cast_cache_[param.id] = c;
    Ref(tensors_[static_cast<size_t>(c.id)].buf);  // the caller's reference, beside the cache's
  }
  return c;
}

void Graph::ClearAutocastCache() {
  for (auto& [param, cast] : cast_cache_) Drop(cast);
  cast_cache_.clear();
}

}  // namespace memplan::estimator::step
