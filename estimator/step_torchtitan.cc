// torchtitan's Llama 3 under FSDP2 in the step model (Note [The step model] in step_model.h):
// the model of torchtitan/models/llama3 (fused wqkv, complex RoPE over a per-block cache,
// F.rms_norm, SDPA), each block checkpointed whole or not, sharded by apply_fsdp_to_decoder
// (torchtitan/distributed/fsdp.py), with its whole-logits loss or its ChunkedLossWrapper
// (torchtitan/components/loss.py).
//
// Note [FSDP2 in the step model]
// fully_shard (torch/distributed/fsdp/_fully_shard, _fsdp_param_group.py, _fsdp_collectives.py)
// keeps each parameter as an fp32 shard (dim 0 padded to a multiple of the ranks) and, per unit
// (the embedding, each block, the final norm with the head), allocates around the unit's use:
//   - unshard (foreach_all_gather): the shards cast to the compute dtype into one flat input, the
//     all-gather's output (ranks times the input), the input gone once the collective has run;
//     with one rank, wait_for_unshard casts each shard and copies it instead.
//   - wait_for_unshard: the copy-out into one unsharded tensor per parameter (parameters); in
//     forward the all-gather's output lives on as the all_gather_state until the next unit's
//     copy-out, in backward it goes at once.
//   - post_forward: reshard (the unsharded tensors go) unless reshard_after_forward is off
//     (torchtitan: the final norm and head).
//   - pre_backward (a hook on the unit's outputs): unshard and copy out, then prefetch the unit
//     before it in forward order (its all-gather output waits for its own copy-out).
//   - post_backward (after the unit's inputs have their gradients): reshard; the gradients
//     (the compute dtype) copied into one reduce-scatter input in the reduce dtype (fp32), the
//     output (a shard of it) becoming the sharded gradients; the input is kept until the next
//     unit's reduce-scatter (one buffer in flight), and the root's final callback frees it. The
//     embedding's inputs need no gradient: its post_backward runs in that final callback.
// FSDPMemTracker counts the collective buffers between modules as communication. The trace runs
// FSDP2 on CPU without streams; how long the buffers live on a GPU follows the same Python
// references (docs/trace.md).
#include <algorithm>
#include <string>

#include "estimator/step_blocks.h"
#include "estimator/step_ops.h"

namespace memplan::estimator::step {

namespace {

constexpr int kReduceBytes = 4;  // torchtitan's mixed_precision_reduce: float32
// FSDP2's streams (FSDPCommContext): the all-gather's copy-in, the all-gather, the
// reduce-scatter. Stream 0 is the default stream.
constexpr int kAllGatherCopyInStream = 1;
constexpr int kAllGatherStream = 2;
constexpr int kReduceScatterStream = 3;

Wide ShardElems(Wide dim0, Wide rest, Wide ranks) { return (dim0 + ranks - 1) / ranks * rest; }

}  // namespace

void ModelRun::PrepareTorchtitan() {
  // torchtitan shards over its data-parallel ranks (dp_shard -1: all of them).
  ranks_ = static_cast<Wide>(std::max<int64_t>(s_.DataParallel(), 1));
  const Wide h = static_cast<Wide>(a_.hidden);
  const Wide vocab = static_cast<Wide>(a_.vocab);
  auto add = [&](FsdpUnit& u, T p, Wide dim0, Wide rest) {
    if (!p.ok()) return;
    u.params.push_back(p);
    u.numel.push_back(dim0 * rest);
    u.padded.push_back(ShardElems(dim0, rest, ranks_) * ranks_);
  };
  g_.SetGradsAsTemporaries(true);
  units_.clear();
  // apply_fsdp_to_decoder: a tied embedding and head are one unit with the final norm, first in
  // forward order; otherwise the embedding, and the final norm with the head last. Neither
  // reshards after forward (the policy is "always" only).
  const bool tied = head_.id == embedding_.id;
  FsdpUnit emb;
  emb.name = tied ? "embedding, final norm and output" : "embedding";
  add(emb, embedding_, vocab, h);
  if (tied) {
    add(emb, final_norms_.back().w, final_norms_.back().width, 1);
    emb.reshard_after_forward = false;
  }
  units_.push_back(emb);
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const BlockParams& bp = blocks_[i];
    FsdpUnit u;
    u.name = "layer " + std::to_string(i);
    const Lin& qkv = litgpt_qkv_[i];
    add(u, qkv.w, qkv.out, qkv.in);
    for (TensorRole r : {TensorRole::kAttentionOut, TensorRole::kMlpGate, TensorRole::kMlpDown,
                         TensorRole::kMlpUp}) {
      if (bp.has(r)) add(u, bp.at(r).w, bp.at(r).out, bp.at(r).in);
    }
    for (const Norm& n : bp.norms) add(u, n.w, n.width, 1);
    units_.push_back(u);
  }
  final_unit_ = 0;
  if (!tied) {
    FsdpUnit fin;
    fin.name = "final norm and output";
    fin.reshard_after_forward = false;
    add(fin, final_norms_.back().w, final_norms_.back().width, 1);
    add(fin, head_, vocab, h);
    units_.push_back(fin);
    final_unit_ = units_.size() - 1;
  }
  head_padded_ = ShardElems(vocab, h, ranks_) * ranks_;
  // The model states as FSDP2 and the optimizer allocate them, each tensor rounded: the fp32
  // shards; Adam's two states per shard, and fused AdamW's step per parameter on the GPU
  // (torch/optim/adamw.py _init_group: a device tensor when fused or capturable); the RoPE cache
  // of each block (ComplexRoPE: seq x head_dim / 2 complex64).
  // The optimizer steps on those fp32 shards: foreach AdamW's sqrt(v) is a shard-sized set, and
  // the per-tensor loop's temporaries are the largest shard's.
  parameter_bytes_ = state_bytes_ = 0;
  largest_trainable_ = 0;
  for (const FsdpUnit& u : units_) {
    for (Wide p : u.padded) {
      const Wide shard = AllocatorRound(static_cast<uint64_t>(p / ranks_ * 4));
      parameter_bytes_ += shard;
      state_bytes_ += 2 * shard;
      largest_trainable_ = std::max(largest_trainable_, shard);
      if (s_.fused_optimizer) state_bytes_ += AllocatorRound(4);
    }
  }
  group_bytes_ = {parameter_bytes_};
  buffer_bytes_ =
      static_cast<Wide>(a_.layers) *
      AllocatorRound(static_cast<uint64_t>(seq_ * static_cast<Wide>(a_.head_dim) / 2 * 8));
}

StepCategory ModelRun::FsdpTransient() const {
  return g_.in_backward() ? StepCategory::kTemporaries : StepCategory::kActivations;
}

void ModelRun::FsdpUnshard(FsdpUnit& u) {
  if (!u.unsharded.empty() || u.gathered >= 0 || ranks_ == 1) return;
  const Wide eb = static_cast<Wide>(Bytes(pdt_));
  Wide in = 0;
  for (Wide p : u.padded) in += p / ranks_;
  const StepCategory c = FsdpTransient();
  // foreach_all_gather: the copy-in on its stream, the output on the all-gather stream (Note
  // [The caching allocator's reserve]: each stream caches its own blocks).
  g_.SetStream(kAllGatherCopyInStream);
  const int input = g_.Alloc(c, in * eb);
  g_.SetStream(kAllGatherStream);
  const int output = g_.Alloc(c, in * eb * ranks_);
  g_.SetStream(0);
  g_.Unref(input);
  g_.Recategorize(output, StepCategory::kCommunication);
  u.gathered = output;
}

void ModelRun::FsdpWait(FsdpUnit& u, bool forward) {
  if (!u.unsharded.empty()) return;
  const Wide eb = static_cast<Wide>(Bytes(pdt_));
  if (ranks_ == 1) {
    // wait_for_unshard with one rank: each shard cast to the compute dtype (all_gather_inputs;
    // the shard itself when the dtypes agree), copied into its unsharded tensor.
    for (size_t i = 0; i < u.params.size(); ++i) {
      const int cast = Half(pdt_) ? g_.Alloc(FsdpTransient(), u.numel[i] * eb) : -1;
      u.unsharded.push_back(g_.Alloc(StepCategory::kParameters, u.padded[i] * eb));
      if (cast >= 0) g_.Unref(cast);
    }
    return;
  }
  FsdpUnshard(u);
  if (forward && ag_state_ >= 0) {
    g_.Unref(ag_state_);  // release_all_gather_state_for_comm_reuse
    ag_state_ = -1;
  }
  for (Wide p : u.padded) u.unsharded.push_back(g_.Alloc(StepCategory::kParameters, p * eb));
  if (forward) {
    ag_state_ = u.gathered;
  } else {
    g_.Unref(u.gathered);
  }
  u.gathered = -1;
}

void ModelRun::FsdpReshard(FsdpUnit& u) {
  for (int b : u.unsharded) g_.Unref(b);
  u.unsharded.clear();
}

void ModelRun::FsdpReduce(const std::vector<int>& grads, Wide elems, bool accumulate, bool tied) {
  // post_backward: at most one reduce-scatter input in flight (reduce_scatter_max_input_buffers
  // 1), then foreach_reduce: the input in the reduce dtype, the gradients copied in and dropped,
  // the output. As traced: several gradients (copied in by chunk_cat, temporaries to the tracker
  // from then) and a tied weight's gradient go before the output is made; one untied gradient
  // lives beside it.
  for (int b : rs_states_) g_.Unref(b);
  rs_states_.clear();
  // foreach_reduce runs on the reduce-scatter stream: its input and output are that stream's.
  g_.SetStream(ranks_ > 1 ? kReduceScatterStream : 0);
  const int input = g_.Alloc(StepCategory::kTemporaries, elems * kReduceBytes);
  const bool several = grads.size() > 1;
  if (several) {
    for (int gb : grads) g_.Recategorize(gb, StepCategory::kTemporaries);
  }
  if (several || tied) {
    for (int gb : grads) g_.Unref(gb);
  }
  const int output = g_.Alloc(StepCategory::kTemporaries, elems / ranks_ * kReduceBytes);
  g_.SetStream(0);
  if (!several && !tied) {
    for (int gb : grads) g_.Unref(gb);
  }
  if (accumulate) {
    g_.Unref(output);  // added into the sharded gradient the head's reduction made
  } else {
    g_.Recategorize(output, StepCategory::kGradients);  // the sharded gradients, kept
  }
  if (ranks_ > 1) g_.Recategorize(input, StepCategory::kCommunication);
  rs_states_.push_back(input);
}

void ModelRun::FsdpPostBackward(FsdpUnit& u) {
  std::vector<int> grads;
  Wide elems = 0;
  bool accumulate = true, tied = false;
  for (size_t i = 0; i < u.params.size(); ++i) {
    const int gb = g_.TakeGrad(u.params[i]);
    if (gb < 0) continue;
    g_.Recategorize(gb, StepCategory::kGradients);  // the tracker's UNSHARDED_GRAD from here
    grads.push_back(gb);
    elems += u.padded[i];
    accumulate = accumulate && reduced_.count(u.params[i].id) > 0;
    reduced_.insert(u.params[i].id);
    tied = tied || (final_unit_ == 0 && u.params[i].id == head_.id);
  }
  FsdpReshard(u);
  if (!grads.empty()) FsdpReduce(grads, elems, accumulate, tied);
}

void ModelRun::FsdpPreBackward(size_t unit, int prefetch) {
  FsdpUnit& u = units_[unit];
  FsdpUnshard(u);
  FsdpWait(u, /*forward=*/false);
  // _backward_prefetch: the unit before this one in post-forward order.
  if (prefetch_ && prefetch >= 0) FsdpUnshard(units_[static_cast<size_t>(prefetch)]);
}

void ModelRun::AfterBackward() {
  if (s_.framework != Framework::kTorchtitan) return;
  // FSDPState._root_post_backward_final_callback: the units whose post_backward did not run (the
  // embedding's inputs need no gradient), then every reduce-scatter waited on and freed.
  g_.SetWhere("embedding backward");
  for (FsdpUnit& u : units_) FsdpPostBackward(u);
  for (int b : rs_states_) g_.Unref(b);
  rs_states_.clear();
  // The chunked loss's gradient of the hidden states, held by its autograd function's context.
  g_.Drop(held_grad_);
  held_grad_ = T{};
}

T ModelRun::TorchtitanBlock(int layer, T x) {
  // TransformerBlock.forward: h = x + attention(attention_norm(x), freqs_cis);
  // h + feed_forward(ffn_norm(h)).
  const BlockParams& bp = blocks_[static_cast<size_t>(layer)];
  const Wide heads = static_cast<Wide>(a_.heads), kv = static_cast<Wide>(a_.kv_heads);
  const Wide d = static_cast<Wide>(a_.head_dim), h = static_cast<Wide>(a_.hidden);
  T xn = FusedRmsNorm(g_, x, bp.norms[0].w, bp.norms[0].width);
  // Attention.forward: the fused projection split into q, k and v, each viewed per head and
  // made contiguous (a copy each); split's backward concatenates their gradients.
  // Under the per-op policy (Note [torchtitan's per-op checkpointing]) the forward keeps what
  // the policy saves, and the recompute takes it back instead of running the op again.
  const bool sac = s_.checkpointing == Checkpointing::kOp;
  std::vector<T>& cache = sac_cache_[layer];
  size_t next = 0;
  auto reuse = [&](size_t n) {
    if (!sac || !sac_recompute_) return;
    g_.ReuseNext(std::vector<T>(cache.begin() + static_cast<std::ptrdiff_t>(next),
                                cache.begin() + static_cast<std::ptrdiff_t>(next + n)));
    next += n;
  };
  auto keep = [&](T t) {
    if (sac && !sac_recompute_) cache.push_back(g_.Alias(t));
  };
  if (sac && !sac_recompute_) cache.clear();
  const Lin& wqkv = litgpt_qkv_[static_cast<size_t>(layer)];
  reuse(1);
  T qkv = Linear(g_, xn, wqkv.w, wqkv.b, h, wqkv.out);  // mm 1: saved
  keep(qkv);
  std::vector<T> parts = {g_.Alias(qkv, tokens_ * heads * d, /*view=*/true),
                          g_.Alias(qkv, tokens_ * kv * d, /*view=*/true),
                          g_.Alias(qkv, tokens_ * kv * d, /*view=*/true)};
  g_.Record(Graph::Spec("SplitWithSizes", {qkv}, parts));
  T q0 = Copy(g_, parts[0]);
  T k0 = Copy(g_, parts[1]);
  T v = Copy(g_, parts[2]);
  for (T p : parts) g_.Drop(p);
  g_.Drop(qkv);
  // apply_rotary_emb: q and k in fp32 as complex pairs times the cache (a buffer; mul saves it
  // only, and its backward multiplies by the cache's conjugate, a copy of seq x head_dim / 2
  // complex), back to the input's dtype; q first, then k, at each step.
  const DT cdt = g_.Dtype(q0);
  T qf = Cast(g_, q0, DT::kF32);
  T kf = Cast(g_, k0, DT::kF32);
  auto complex_mul = [&](T t) {
    T out = g_.New(g_.Numel(t), DT::kF32, g_.RequiresGrad(t));
    Graph::NodeSpec spec = Graph::Spec("ComplexMul", {t}, {out});
    spec.extra = {{seq_ * d, DT::kF32}};
    g_.Record(std::move(spec));
    return out;
  };
  T qm = complex_mul(qf);
  T km = complex_mul(kf);
  T q = Cast(g_, qm, cdt);
  T k = Cast(g_, km, cdt);
  for (T t : {q0, k0, qf, kf, qm, km}) g_.Drop(t);
  // inner_attention: SDPA over (B, heads, L, d) views, causal, enable_gqa (no repeated k, v).
  const AttentionShape as = SelfAttentionShape(heads, kv, d);
  std::vector<T> stats;
  reuse(4);
  T att = Sdpa(g_, CausalSdpaBackend(cdt), q, k, v, as, T{}, sac ? &stats : nullptr);
  keep(att);
  for (T st : stats) {
    if (!sac_recompute_)
      cache.push_back(st);
    else
      g_.Drop(st);
  }
  T o = Linear(g_, att, bp.at(TensorRole::kAttentionOut).w, T{}, heads * d, h);  // mm 2
  // Attention.forward's argument and locals (the normed input, the roped q and k, v, the
  // attention's output) live until it returns wo's result.
  for (T t : {xn, q, k, v, att}) g_.Drop(t);
  T x2 = Add(g_, x, o);
  g_.Drop(o);
  // FeedForward.forward: w2(F.silu(w1(x)) * w3(x)).
  T hn = FusedRmsNorm(g_, x2, bp.norms[1].w, bp.norms[1].width);
  const Lin& w1 = bp.at(TensorRole::kMlpGate);
  const Lin& w3 = bp.at(TensorRole::kMlpUp);
  const Lin& w2 = bp.at(TensorRole::kMlpDown);
  reuse(1);
  T g1 = Linear(g_, hn, w1.w, T{}, h, w1.out);  // mm 3: saved
  keep(g1);
  T a = Apply(g_, Unary::kSilu, g1);
  g_.Drop(g1);
  T u = Linear(g_, hn, w3.w, T{}, h, w3.out);  // mm 4
  T m = Mul(g_, a, u);
  g_.Drop(a);
  g_.Drop(u);
  reuse(1);
  T down = Linear(g_, m, w2.w, T{}, w2.in, h);  // mm 5: saved
  keep(down);
  g_.Drop(m);
  g_.Drop(hn);  // FeedForward.forward's argument, until it returns
  T out = Add(g_, x2, down);
  g_.Drop(x2);
  g_.Drop(down);
  return out;
}

// Note [torchtitan's per-op checkpointing]
// SelectiveAC with mode "op" (torchtitan/distributed/activation_checkpoint.py) wraps each block
// in a non-reentrant checkpoint whose policy (create_selective_checkpoint_contexts) saves the
// outputs of the compute-intensive ops: every second mm/linear in call order (the first, third
// and fifth of a block: wqkv, w1, w2) and the attention kernel (its output, log-sum-exp and RNG
// state). The forward keeps those and the block's input; the recompute, whole (early_stop off),
// takes the saved outputs from the cache instead of running those ops, and the cache lets them
// go as it does.
T ModelRun::TorchtitanRunBlock(int layer, T x) {
  if (s_.checkpointing == Checkpointing::kNone) return TorchtitanBlock(layer, x);
  g_.SetSaving(false);
  T out = TorchtitanBlock(layer, x);
  g_.SetSaving(true);
  const bool sac = s_.checkpointing == Checkpointing::kOp;
  std::vector<T>& cache = sac_cache_[layer];
  g_.RecordCheckpoint(
      x, out,
      [this, layer](T in) {
        // The recompute runs the wrapped block without its submodules' hooks, so the tracker
        // counts everything it makes as temporaries (as a block's own ops, SetBlockBody).
        sac_recompute_ = true;
        g_.SetBlockBody(true);
        T o = TorchtitanBlock(layer, in);
        g_.SetBlockBody(false);
        sac_recompute_ = false;
        return o;
      },
      {}, sac ? cache : std::vector<T>{}, /*early_stop=*/!sac);
  for (T c : cache) g_.Drop(c);  // the checkpoint holds them now
  return out;
}

Result<T> ModelRun::TorchtitanForward() {
  if (!a_.causal || a_.encoder_decoder || a_.experts > 0 || !a_.gated_mlp || a_.rotary_dims == 0 ||
      inv_.model_type != "llama") {
    return Status::Unimplemented(inv_.name +
                                 ": the step model runs torchtitan's Llama 3 (llama models) only");
  }
  if (s_.lora_rank > 0) {
    return Status::Unimplemented("the step model runs torchtitan for full training only");
  }
  if (!s_.flash_attention) {
    return Status::Unimplemented("torchtitan attends through flash kernels; it has no eager path");
  }
  if (s_.checkpointing == Checkpointing::kSelective) {
    return Status::Unimplemented("torchtitan 0.3 has full and per-op (op) checkpointing");
  }
  if (s_.checkpointing == Checkpointing::kFull && s_.checkpoint_every > 1) {
    return Status::Unimplemented("torchtitan 0.3 checkpoints every block");
  }
  MEMPLAN_RETURN_IF_ERROR(CheckFamily());
  for (const BlockParams& bp : blocks_) {
    if (!bp.has(TensorRole::kMlpGate) || !bp.has(TensorRole::kMlpUp) || bp.norms.size() < 2) {
      return Status::Unimplemented(inv_.name + ": torchtitan's FeedForward needs w1, w2 and w3");
    }
  }
  const bool chunked = s_.loss == Loss::kChunked;
  const Wide h = static_cast<Wide>(a_.hidden), vocab = static_cast<Wide>(a_.vocab);
  const size_t last = final_unit_;  // 0: the head is tied into the embedding's unit
  // The root unit holds no parameters; every FSDP unit's forward runs its hooks around it. A
  // tied unit stays unsharded after the embedding when its whole group runs in the forward
  // (the whole-logits loss); the chunked loss runs the head later, and the group's partial
  // post-forward reshards it.
  g_.SetWhere("embedding");
  FsdpWait(units_[0], /*forward=*/true);
  T x = Embedding(g_, embedding_, tokens_, h, pdt_);
  if (units_[0].reshard_after_forward || chunked) FsdpReshard(units_[0]);
  g_.RecordHook([this] { FsdpPreBackward(0, -1); });
  for (int64_t i = 0; i < a_.layers; ++i) {
    const size_t unit = static_cast<size_t>(i) + 1;
    g_.SetWhere("layer " + std::to_string(i));
    FsdpWait(units_[unit], /*forward=*/true);
    g_.RecordHook([this, unit] {
      g_.SetWhere(units_[unit].name + " backward");
      FsdpPostBackward(units_[unit]);
    });
    T next = TorchtitanRunBlock(static_cast<int>(i), x);
    g_.Drop(x);
    x = next;
    if (units_[unit].reshard_after_forward) FsdpReshard(units_[unit]);
    g_.RecordHook([this, unit] {
      g_.SetWhere(units_[unit].name + " backward");
      FsdpPreBackward(unit, static_cast<int>(unit) - 1);
    });
  }
  g_.SetWhere("final norm");
  FsdpUnit& fin = units_[last];
  FsdpWait(fin, /*forward=*/true);
  g_.RecordHook([this, last] {
    g_.SetWhere("final norm backward");
    FsdpPostBackward(units_[last]);
  });
  T hn = FusedRmsNorm(g_, x, final_norms_.back().w, final_norms_.back().width);
  g_.Drop(x);
  const int last_layer = static_cast<int>(a_.layers);  // its unit: the layers follow unit 0
  g_.RecordHook([this, last, last_layer] { FsdpPreBackward(last, last_layer); });
  if (!chunked) {
    // The head in the model's forward; the unit stays unsharded (reshard_after_forward off).
    // Its post_backward, registered on the head's input too, runs once the head's backward has
    // given the hidden states their gradient: the head's gradient is reduced alone, the unit
    // resharded, and the norm's backward unshards it again.
    g_.RecordHook([this, last] { FsdpPostBackward(units_[last]); });
    g_.SetWhere("output");
    T logits = Linear(g_, hn, head_, T{}, h, vocab);
    g_.Drop(hn);
    g_.SetPhase(StepPhase::kLoss);
    if (ag_state_ >= 0) g_.Unref(ag_state_);
    ag_state_ = -1;
    // cross_entropy_loss: pred.flatten(0, 1).float() into F.cross_entropy (sum) / tokens; the
    // trainer deletes pred before backward.
    T up = Cast(g_, logits, DT::kF32);
    T l = CrossEntropy(g_, up, tokens_, vocab);
    g_.Drop(up);
    T loss = Scale(g_, l);
    g_.Drop(l);
    g_.Drop(logits);
    return loss;
  }
  // ChunkedLossWrapper: the model's forward ends at the norm; the unit's group ran partly, and
  // the root's post-forward reshards it.
  FsdpReshard(fin);
  g_.SetPhase(StepPhase::kLoss);
  g_.SetWhere("chunked loss");
  if (ag_state_ >= 0) g_.Unref(ag_state_);
  ag_state_ = -1;
  // Each chunk's backward ends in the root's final callback, which clears the post-forward order:
  // the step's backward prefetches nothing.
  prefetch_ = false;
  const Wide chunks = static_cast<Wide>(std::max<int64_t>(s_.loss_chunks, 1));
  const Wide ct = tokens_ / chunks;
  // _chunk_local: torch.split along the sequence, each chunk .contiguous() (a copy when the
  // batch holds more than one sequence), detached into a leaf that requires grad; the labels
  // too.
  std::vector<T> h_chunks, label_chunks;
  for (Wide c = 0; c < chunks; ++c) {
    h_chunks.push_back(batch_ > 1 ? g_.New(ct * h, g_.Dtype(hn), true)
                                  : g_.Alias(hn, ct * h, true));
    g_.SetRequiresGrad(h_chunks.back(), true);
  }
  if (batch_ > 1) {
    for (Wide c = 0; c < chunks; ++c) label_chunks.push_back(g_.New(ct, DT::kI64, false));
  }
  T acc = g_.New(tokens_ * h, DT::kF32, false);  // GradAccumulator's fp32 buffer
  T total = g_.New(1, DT::kF32, false);
  // lm_head.unshard() while idle, waited on by the first chunk's pre_forward.
  FsdpUnshard(fin);
  FsdpWait(fin, /*forward=*/false);
  int head_grad = -1;  // the head's unsharded gradient, upcast to fp32 while sync is off
  T logits;
  for (Wide c = 0; c < chunks; ++c) {
    const size_t mark = g_.NodeCount();
    T lg = Linear(g_, h_chunks[static_cast<size_t>(c)], head_, T{}, h, vocab);
    g_.Drop(logits);
    logits = lg;
    T up = Cast(g_, lg, DT::kF32);
    T l = CrossEntropy(g_, up, ct, vocab);
    g_.Drop(up);
    T cl = Scale(g_, l);
    g_.Drop(l);
    g_.BackwardTail(cl, mark);
    g_.Drop(cl);
    // The head's post_backward: with gradient sync off (chunks before the last) the unsharded
    // gradient accumulates in the reduce dtype (_set_unsharded_grad_dtypes); the last chunk's
    // reduce-scatters it.
    const int gb = g_.TakeGrad(head_, /*graph_local=*/true);
    if (gb >= 0) {
      if (head_grad < 0 && pdt_ != DT::kF32) {
        head_grad = g_.Alloc(StepCategory::kTemporaries, static_cast<Wide>(vocab) * h * 4);
        g_.Unref(gb);
        g_.Recategorize(head_grad, StepCategory::kGradients);
      } else if (head_grad < 0) {
        head_grad = gb;
        g_.Recategorize(head_grad, StepCategory::kGradients);
      } else {
        g_.Unref(gb);  // added in place
      }
    }
    if (c + 1 == chunks && head_grad >= 0) {
      FsdpReduce({head_grad}, head_padded_, /*accumulate=*/false, /*tied=*/last == 0);
      reduced_.insert(head_.id);
      head_grad = -1;
      for (int b : rs_states_) g_.Unref(b);  // the chunk backward's final callback
      rs_states_.clear();
    }
    // GradAccumulator.add: the chunk's gradient copied into the fp32 buffer.
    const int hg = g_.TakeGrad(h_chunks[static_cast<size_t>(c)]);
    if (hg >= 0) {
      const int up32 = g_.Alloc(StepCategory::kTemporaries, ct * h * 4);
      g_.Unref(hg);
      g_.Unref(up32);
    }
  }
  g_.Drop(logits);
  for (T t : h_chunks) g_.Drop(t);
  for (T t : label_chunks) g_.Drop(t);
  g_.Drop(total);
  FsdpReshard(fin);  // lm_head.reshard()
  // grad_accumulator.result().to(hidden dtype), returned by _gradient_backprop's backward as the
  // hidden states' gradient.
  T grad = g_.New(tokens_ * h, g_.Dtype(hn), false);
  g_.Drop(acc);
  T loss = g_.New(1, DT::kF32, true);
  held_grad_ = grad;
  g_.RecordHook([this, hn, grad] { g_.SetGrad(hn, grad); });
  g_.Drop(hn);
  return loss;
}

}  // namespace memplan::estimator::step
