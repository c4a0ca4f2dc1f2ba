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
void ModelRun::MlaRotaryTable() {
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
  T q_pe = MlaRotary(qs[1]);
  g_.Drop(qs[1]);
  T k_pe = MlaRotary(kvs[1]);
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
  T out = s_.flash_attention ? TransformersSdpa(as, cdt, &t) : MlaEagerAttention(t, as);
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
T ModelRun::DeepseekV2Router(const BlockParams& bp, T h) {
  const Wide hw = static_cast<Wide>(a_.hidden);
  const Wide experts = static_cast<Wide>(a_.experts);
  T hf = Cast(g_, h, DT::kF32);
  T wf = g_.Dtype(bp.router.w) == DT::kF32 ? bp.router.w : Cast(g_, bp.router.w, DT::kF32);
  T logits = Linear(g_, hf, wf, T{}, hw, experts);
  g_.Drop(hf);
  g_.Drop(wf);
  T top = TopKRouting(logits);
  T scaled = Scale(g_, top);  // topk_weights * routed_scaling_factor
  g_.Drop(top);
  return scaled;
}

}  // namespace memplan::estimator::step
