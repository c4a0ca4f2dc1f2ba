// DeepSeek-V2's multi-head latent attention and its router in the step model (Note [The step
// model] in step_model.h), as Transformers 5 runs DeepseekV2ForCausalLM
// (models/deepseek_v2/modeling_deepseek_v2.py): the decoder layer is Llama's (two RMSNorms, the
// attention, the MLP), the first first_k_dense_replace layers with a dense DeepseekV2MLP and the
// others with DeepseekV2Moe, whose experts run through integrations/moe.py as Qwen3-MoE's do
// (TransformersMoe); what differs is modelled here.
//
// Note [DeepSeek-V2 in the step model]
// DeepseekV2Attention.forward, op by op:
//   q = q_proj(x)   (or q_b_proj(q_a_layernorm(q_a_proj(x))) when q_lora_rank is set)
//   q_nope, q_pe = split(q, [qk_nope, qk_rope])           one SplitWithSizes node, views
//   compressed_kv = kv_a_proj_with_mqa(x)
//   kv_nope, k_pe = split(compressed_kv, [kv_lora_rank, qk_rope])
//   k_nope = kv_a_layernorm(kv_nope)                       the RMSNorm of every Llama block
//   q_pe, k_pe = apply_rotary_emb(q_pe, k_pe, freqs_cis)   complex: x.float() viewed as complex,
//                                                          times freqs_cis, .type_as(x)
//   k_nope, k_pe = past_key_values.update(k_nope, k_pe)    DynamicCache's cat copies (use_cache)
//   query_states = cat(q_nope, q_pe)
//   kv = kv_b_proj(k_nope)                                 expand_kv: heads x (qk_nope + v)
//   k_nope, value_states = split(kv, [qk_nope, v_head_dim])
//   key_states = kv.new_empty(...); key_states[..., :nope].copy_(k_nope);
//                key_states[..., nope:].copy_(k_pe.expand(heads))
//   attention(query_states, key_states, value_states), o_proj
// The query and key heads are qk_nope + qk_rope wide and the value heads v_head_dim: SDPA's flash
// kernel needs equal widths, so SDPA takes the memory-efficient kernel (TransformersSdpa). The
// value is a view of kv_b_proj's output, so the attention keeps the whole of it. The rotary
// multiply saves freqs_cis only (the table needs no gradient): the fp32 copies of q_pe and k_pe
// go as soon as the product is made.
//
// DeepseekV2TopkRouter.forward runs the router Linear in fp32 (hidden_states.type(float32),
// weight.type(float32): copies in a 16-bit model, saved by the mm; autocast still runs the
// Linear in 16 bits), softmax in fp32, topk, and scales the weights by routed_scaling_factor;
// they stay fp32, so the experts' weighted outputs promote to fp32 and the experts' sum is cast
// back to the hidden states' dtype (grouped_mm_experts_forward's .to(hidden_states.dtype)).
//
// Note [DeepSeek-V3 in the step model]
// DeepseekV3Attention (models/deepseek_v3/modeling_deepseek_v3.py) is V2's with a real rotation:
// DeepseekV3RotaryEmbedding makes Llama's cos and sin tables (seq x qk_rope, fp32, cast to the
// hidden states' dtype) once for every layer, and each layer rotates q_rot and k_rot with them,
// by default pairwise (rope_interleave: apply_rotary_pos_emb_interleave, which multiplies the
// even and odd elements by views of the tables' first halves and cats the two results), else as
// Llama does. The products promote to the tables' dtype: under autocast the rotated parts are
// fp32, so the query's cat is fp32 and SDPA's autocast copy of it is what the attention keeps.
// The multiplies save the tables only (no gradient), which every layer shares.
//
// DeepseekV3TopkRouter.forward: the router Linear as V2's (fp32 casts, autocast's 16 bits
// still), then scores = sigmoid(logits), which sigmoid's backward keeps; the group selection
// (scores + e_score_correction_bias, a group top-2 sum, a group top-k, a zeros-and-scatter
// group mask expanded to experts, masked_fill) and the top-k that only yields indices; the
// weights gathered from the scores (gather keeps the indices); when norm_topk_prob, an in-place
// division by their sum + 1e-20 (an fp32 sum under autocast), which keeps the divisor and a clone
// of the weights; then a multiply by routed_scaling_factor. The weights keep the scores' dtype
// (16 bits under autocast, where V2's are fp32). The group tensors of tokens x n_group elements
// are not laid out: they live inside the router's forward, where the step never peaks.
//
// Not modelled, and refused (the family reader makes it a block option): topk_method
// "group_limited_greedy" (DeepSeek-V2's full model: its group mask adds a few [tokens, experts]
// tensors per MoE layer).
#include <algorithm>

#include "estimator/step_blocks.h"
#include "estimator/step_ops.h"

namespace memplan::estimator::step {

// DeepseekV2Model.forward's position_ids (arange(seq) + past_seen_tokens, int64), held in sin_:
// every layer is called with them, so each checkpoint keeps them until its backward. Then
// DeepseekV2RotaryEmbedding.forward (under no_grad): position_ids.float() * inv_freq, and
// torch.polar(ones_like(freqs), freqs) * attention_scaling: a complex64 table of seq x
// qk_rope / 2, kept for every layer (held in cos_).
void ModelRun::MlaRotaryTable(DT dt) {
  if (fam_.mla_v3) {
    // DeepseekV3RotaryEmbedding.forward: cos and sin of seq x qk_rope in fp32 (times
    // attention_scaling), cast to the hidden states' dtype (the embeddings' here).
    const Wide d = static_cast<Wide>(a_.qk_rope_head_dim);
    T c32 = g_.New(seq_ * d, DT::kF32, false);
    T s32 = g_.New(seq_ * d, DT::kF32, false);
    cos_ = Cast(g_, c32, dt);
    sin_ = Cast(g_, s32, dt);
    g_.Drop(c32);
    g_.Drop(s32);
    return;
  }
  const Wide half = static_cast<Wide>(a_.qk_rope_head_dim) / 2;
  T arange = g_.New(seq_, DT::kI64, false);
  sin_ = g_.New(seq_, DT::kI64, false);
  g_.Drop(arange);
  T pos = g_.New(seq_, DT::kF32, false);
  T freqs = g_.New(seq_ * half, DT::kF32, false);
  g_.Drop(pos);
  T ones = g_.New(seq_ * half, DT::kF32, false);
  T polar = g_.New(2 * seq_ * half, DT::kF32, false);  // complex64: two fp32 per element
  g_.Drop(ones);
  g_.Drop(freqs);
  cos_ = g_.New(2 * seq_ * half, DT::kF32, false);
  g_.Drop(polar);
}

// apply_rotary_emb for one of q_pe / k_pe: view_as_complex(x.float()) * freqs_cis, view_as_real,
// .type_as(x). The mul saves freqs_cis only.
T ModelRun::MlaRotary(T x) {
  const DT dt = g_.Dtype(x);
  T xf = Cast(g_, x, DT::kF32);
  T prod = Mul(g_, xf, cos_);
  g_.Drop(xf);
  T out = Cast(g_, prod, dt);
  g_.Drop(prod);
  return out;
}

// DeepSeek-V3's rotation of q_rot or k_rot (Note [DeepSeek-V3 in the step model]): pairwise,
// cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin]) over the even and odd elements x1, x2 and the
// tables' first halves; or Llama's x * cos + rotate_half(x) * sin.
T ModelRun::MlaV3Rotary(T x) {
  if (!a_.rope_interleave) return RotateHalf(x);
  const Wide n = g_.Numel(x);
  T x1 = Slice(g_, x, n / 2);
  T x2 = Slice(g_, x, n / 2);
  const Wide rows = seq_ * static_cast<Wide>(a_.qk_rope_head_dim) / 2;
  T cos_half = g_.Alias(cos_, rows, /*view=*/true);
  T sin_half = g_.Alias(sin_, rows, /*view=*/true);
  T a1 = Mul(g_, x1, cos_half);
  T a2 = Mul(g_, x2, sin_half);
  T first = Add(g_, a1, a2);  // a subtraction: the same tensors
  g_.Drop(a1);
  g_.Drop(a2);
  T b1 = Mul(g_, x2, cos_half);
  T b2 = Mul(g_, x1, sin_half);
  T second = Add(g_, b1, b2);
  g_.Drop(b1);
  g_.Drop(b2);
  g_.Drop(x1);
  g_.Drop(x2);
  g_.Drop(cos_half);
  g_.Drop(sin_half);
  T out = Cat(g_, {first, second});
  g_.Drop(first);
  g_.Drop(second);
  return out;
}

// torch.split of `x` into views of the given element counts: one SplitWithSizes node, whose
// backward makes one gradient of x's size from the parts'.
std::vector<T> ModelRun::MlaSplit(T x, const std::vector<Wide>& parts) {
  std::vector<T> out;
  for (Wide n : parts) out.push_back(g_.Alias(x, n, /*view=*/true));
  g_.Record(Graph::Spec("SplitWithSizes", {x}, out));
  return out;
}

T ModelRun::MlaAttention(const BlockParams& bp, T h) {
  const Wide heads = static_cast<Wide>(a_.heads);
  const Wide nope = static_cast<Wide>(a_.qk_nope_head_dim);
  const Wide rope = static_cast<Wide>(a_.qk_rope_head_dim);
  const Wide vd = static_cast<Wide>(a_.v_head_dim);
  const Wide rank = static_cast<Wide>(a_.kv_lora_rank);
  // The query: q_proj, or q_b_proj(q_a_layernorm(q_a_proj(x))); the low-rank norms are the
  // block's narrow norms in registration order (q_a_layernorm, then kv_a_layernorm).
  T q;
  size_t kv_norm = 0;
  if (bp.has(TensorRole::kAttentionQDown)) {
    T qa = LoraLinear(bp.at(TensorRole::kAttentionQDown), h);
    T qn = HfRmsNorm(bp.qk_norms[0], qa);
    g_.Drop(qa);
    q = LoraLinear(bp.at(TensorRole::kAttentionQ), qn);
    g_.Drop(qn);
    kv_norm = 1;
  } else {
    q = LoraLinear(bp.at(TensorRole::kAttentionQ), h);
  }
  std::vector<T> qs = MlaSplit(q, {tokens_ * heads * nope, tokens_ * heads * rope});
  g_.Drop(q);
  T compressed = LoraLinear(bp.at(TensorRole::kAttentionKvDown), h);
  std::vector<T> kvs = MlaSplit(compressed, {tokens_ * rank, tokens_ * rope});
  g_.Drop(compressed);
  T k_nope = HfRmsNorm(bp.qk_norms[kv_norm], kvs[0]);
  g_.Drop(kvs[0]);
  T q_pe = fam_.mla_v3 ? MlaV3Rotary(qs[1]) : MlaRotary(qs[1]);
  g_.Drop(qs[1]);
  T k_pe = fam_.mla_v3 ? MlaV3Rotary(kvs[1]) : MlaRotary(kvs[1]);
  g_.Drop(kvs[1]);
  if (use_cache_) {
    // DynamicCache.update: the first update cats onto an empty tensor of k_nope's dtype, copying
    // k_nope and k_pe (promoted to it); the cache holds them until the output is dropped, and
    // the layer goes on with the copies.
    CacheUpdate(&k_nope, &k_pe);
  }
  QkvViews t;
  t.q = Cat(g_, {qs[0], q_pe});
  g_.Drop(qs[0]);
  g_.Drop(q_pe);
  // expand_kv: kv_b_proj, split into k_nope and the value (views), the key assembled in a new
  // tensor by two copy_ into its slices (CopySlices: its backward copies the key's gradient
  // whole, and makes k_pe's gradient per head before expand's sum).
  T kv = LoraLinear(bp.at(TensorRole::kAttentionKvUp), k_nope);
  g_.Drop(k_nope);
  std::vector<T> kvp = MlaSplit(kv, {tokens_ * heads * nope, tokens_ * heads * vd});
  g_.Drop(kv);
  t.k = g_.New(tokens_ * heads * (nope + rope), g_.Dtype(kvp[0]), true);
  Graph::NodeSpec copies = Graph::Spec("CopySlices", {kvp[0], k_pe}, {t.k});
  copies.extra = {{g_.Numel(t.k), g_.Dtype(t.k)}, {tokens_ * heads * rope, g_.Dtype(t.k)}};
  g_.Record(std::move(copies));
  g_.Drop(kvp[0]);
  g_.Drop(k_pe);
  t.v = kvp[1];
  AttentionShape as = SelfAttentionShape(heads, heads, nope + rope);
  as.v_head_dim = vd;
  as.dropout = a_.attention_dropout;
  as.mask = explicit_mask_;
  const DT cdt = autocast_ ? adt_ : g_.Dtype(t.q);
  T out = sdpa_ ? TransformersSdpa(as, cdt, &t) : MlaEagerAttention(t, as);
  g_.Drop(t.q);
  g_.Drop(t.k);
  g_.Drop(t.v);
  T o = LoraLinear(bp.at(TensorRole::kAttentionOut), out);
  g_.Drop(out);
  return o;
}

// eager_attention_forward with MLA's widths: q @ k^T * scaling, + mask, softmax in fp32 cast
// back, dropout, @ v, transpose(1, 2).contiguous() (no grouped heads to repeat).
T ModelRun::MlaEagerAttention(const QkvViews& t, const AttentionShape& as) {
  const Wide rows = batch_ * as.heads * seq_;
  T scores = AutocastBmm(g_, "Matmul(qk)", g_.Alias(t.q), g_.Alias(t.k), rows * seq_);
  T scaled = Scale(g_, scores);
  g_.Drop(scores);
  T masked = Add(g_, scaled, mask_);
  g_.Drop(scaled);
  T probs = Softmax(g_, masked, DT::kF32);
  g_.Drop(masked);
  T pc = Cast(g_, probs, g_.Dtype(t.q));
  g_.Drop(probs);
  T dropped = Dropout(g_, pc, a_.attention_dropout);
  g_.Drop(pc);
  T o = AutocastBmm(g_, "Matmul(pv)", dropped, g_.Alias(t.v), rows * as.v_head_dim);
  T out = Copy(g_, o);
  g_.Drop(o);
  return out;
}

// DeepseekV2TopkRouter.forward ("greedy"): the routing weights of each token's top-k experts,
// fp32, as the experts take them.
ModelRun::Routing ModelRun::DeepseekV2Router(const BlockParams& bp, T h) {
  const Wide hw = static_cast<Wide>(a_.hidden);
  const Wide experts = static_cast<Wide>(a_.experts);
  T hf = Cast(g_, h, DT::kF32);
  T wf = g_.Dtype(bp.router.w) == DT::kF32 ? bp.router.w : Cast(g_, bp.router.w, DT::kF32);
  T logits = Linear(g_, hf, wf, T{}, hw, experts);
  g_.Drop(hf);
  g_.Drop(wf);
  Routing r = TopKRouting(logits);
  T scaled = Scale(g_, r.weights);  // topk_weights * routed_scaling_factor
  g_.Drop(r.weights);
  r.weights = scaled;
  return r;
}

// DeepseekV3TopkRouter.forward (Note [DeepSeek-V3 in the step model]): the routing weights of
// each token's top-k experts, in the scores' dtype.
ModelRun::Routing ModelRun::DeepseekV3Router(const BlockParams& bp, T h) {
  const Wide hw = static_cast<Wide>(a_.hidden);
  const Wide experts = static_cast<Wide>(a_.experts);
  const Wide k = static_cast<Wide>(std::max<int64_t>(a_.experts_per_token, 1));
  T hf = Cast(g_, h, DT::kF32);
  T wf = g_.Dtype(bp.router.w) == DT::kF32 ? bp.router.w : Cast(g_, bp.router.w, DT::kF32);
  T logits = Linear(g_, hf, wf, T{}, hw, experts);
  g_.Drop(hf);
  g_.Drop(wf);
  T scores = Apply(g_, Unary::kSigmoid, logits);
  // The selection: scores + the fp32 bias, the experts' group mask (an fp32 copy and its
  // negated bool), masked_fill; then a top-k whose indices alone are used.
  T choice = g_.New(tokens_ * experts, Promote(g_.Dtype(scores), DT::kF32), false);
  T mask = g_.New(tokens_ * experts, DT::kF32, false);
  T bool_mask = g_.New(tokens_ * experts, DT::kBool, false);
  g_.Drop(mask);
  T filled = g_.New(tokens_ * experts, g_.Dtype(choice), false);
  g_.Drop(choice);
  g_.Drop(bool_mask);
  T top_values = g_.New(tokens_ * k, g_.Dtype(filled), false);
  T top_idx = g_.New(tokens_ * k, DT::kI64, false);
  g_.Drop(filled);
  g_.Drop(top_values);
  // scores.gather(1, topk_indices): keeps the indices.
  T weights = g_.New(tokens_ * k, g_.Dtype(scores), g_.RequiresGrad(scores));
  g_.Record(Graph::Spec("Gather", {scores}, {weights}, {top_idx}));
  g_.Drop(scores);
  // denominator = topk_weights.sum(-1, keepdim=True) + 1e-20; topk_weights /= denominator.
  if (a_.norm_topk_prob) weights = NormalizeTopK(weights, /*epsilon=*/true);
  T scaled = Scale(g_, weights);  // topk_weights * routed_scaling_factor
  g_.Drop(weights);
  return Routing{logits, scaled, top_idx};
}

}  // namespace memplan::estimator::step
