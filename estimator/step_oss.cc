// gpt-oss in the step model (Note [The step model] in step_model.h), as Transformers 5 runs
// GptOssForCausalLM (models/gpt_oss/modeling_gpt_oss.py): the decoder layer is Llama's (two
// RMSNorms, the attention, the MLP, residual sums), with GptOssRMSNorm multiplying its weight in
// fp32 before the cast (Olmo-2's order); what differs is modelled here.
//
// Note [gpt-oss in the step model]
// GptOssModel.forward makes, before the layers: DynamicCache(config) (use_cache), whose
// DynamicSlidingWindowLayer keeps a 0-dim int64 _sliding_window_tensor per sliding layer until
// the output goes; position_ids (arange, int64); the two masks of create_causal_mask and
// create_sliding_window_causal_mask, additive in the embeddings' dtype for eager attention
// (batch x 1 x seq x seq each, whatever the window); then GptOssRotaryEmbedding.forward:
// position_ids.float() * inv_freq, cos() and sin() times attention_scaling, head_dim / 2 wide
// (no cat of the frequencies), cast to the hidden states' dtype. Each layer is called with the
// mask of its config.layer_types entry.
//
// GptOssAttention.forward, op by op:
//   q, k, v = q_proj(x), k_proj(x), v_proj(x)                  biased Linears
//   apply_rotary_pos_emb -> _apply_rotary_emb per q and k:
//     first, second = torch.chunk(x, 2, dim=-1)               one SplitBackward, views
//     cat(first * cos - second * sin, second * cos + first * sin)
//   (the function holds q and k until both are rotated)
//   past_key_values.update: DynamicCache's cat onto empty copies of key and value
//   eager_attention_forward:
//     repeat_kv(k), repeat_kv(v)                               copies to every query head
//     attn_weights = q @ k^T * scaling + mask
//     combined = cat([attn_weights, sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)], -1)
//     combined = combined - combined.max(dim=-1, keepdim=True).values    max saves its indices
//     probs = softmax(combined, dim=-1, dtype=combined.dtype)             saves its result
//     attn_weights = dropout(probs[..., :-1]).to(value.dtype)             a view of probs
//     attn_output = (attn_weights @ v).transpose(1, 2).contiguous()
//   (combined and attn_weights live until the function returns), o_proj.
// The grid runs gpt-oss eager: GptOssPreTrainedModel sets _supports_sdpa = False, so
// Transformers builds it with eager attention unless a flash kernel from the Hub is asked for,
// and the step model runs eager whatever the setup's attention says.
//
// GptOssMLP.forward: GptOssTopKRouter (F.linear with bias, topk over the logits, softmax of the
// top values in their dtype; the logits stay referenced until the MLP returns), then GptOssExperts
// through integrations/moe.py grouped_mm_experts_forward (use_experts_implementation with
// is_transposed and has_bias): sort of the expert ids, the tokens gathered k times, the
// histogram's offsets, gate_up_proj_bias[expert_ids] gathered per row and added in place to the
// grouped matmul's output, GptOssExperts._apply_gate on the interleaved halves:
//   gate, up = gate_up[..., ::2], gate_up[..., 1::2]           strided views
//   gate = gate.clamp(max=limit); up = up.clamp(-limit, limit)  each saves its view (the whole)
//   glu = gate * sigmoid(gate * alpha); out = (up + 1) * glu
// the down projection with its gathered bias, the routing weights, the inverse permutation
// (empty_like, arange, index_put_), the gather back and the sum over k.
//
// Not modelled: _keep_in_fp32_modules (the norms' weights stay fp32 in a 16-bit model; counted
// here in the model's dtype), the Hub's MegaBlocks and flash-attention kernels.
#include <algorithm>

#include "estimator/step_blocks.h"
#include "estimator/step_ops.h"

namespace memplan::estimator::step {

Status ModelRun::CheckGptOss() const {
  for (const BlockParams& bp : blocks_) {
    if (!bp.sinks.ok() || !bp.router.b.ok() ||
        bp.expert_bias.count(TensorRole::kExpertGateUp) == 0 ||
        bp.expert_bias.count(TensorRole::kExpertDown) == 0 ||
        bp.expert.count(TensorRole::kExpertGateUp) == 0) {
      return Status::Unimplemented(inv_.name +
                                   ": the step model expects attention sinks, a biased router "
                                   "and biased gate_up/down experts in every gpt-oss block");
    }
  }
  return Status::Ok();
}

T ModelRun::LayerMask(int layer) const {
  const auto& sliding = a_.sliding_layers;
  const size_t i = static_cast<size_t>(layer);
  if (fam_.gpt_oss && sliding_mask_.ok() && i < sliding.size() && sliding[i]) return sliding_mask_;
  return mask_;
}

void ModelRun::GptOssTables(DT dt) {
  if (use_cache_) {
    // DynamicSlidingWindowLayer.__init__: torch.tensor(sliding_window, dtype=torch.long).
    for (bool sliding : a_.sliding_layers) {
      if (sliding) cache_.push_back(g_.New(1, DT::kI64, false));
    }
  }
  // position_ids = arange(seq) + past_seen_tokens, kept by the model's forward.
  T arange = g_.New(seq_, DT::kI64, false);
  positions_ = g_.New(seq_, DT::kI64, false);
  g_.Drop(arange);
  // The masks: a boolean of the allowed pairs made additive (torch.where) in x's dtype.
  const bool any_sliding =
      std::any_of(a_.sliding_layers.begin(), a_.sliding_layers.end(), [](bool b) { return b; });
  auto make_mask = [&] {
    T allowed = g_.New(batch_ * seq_ * seq_, DT::kBool, false);
    T mask = g_.New(batch_ * seq_ * seq_, dt, false);
    g_.Drop(allowed);
    return mask;
  };
  mask_ = make_mask();
  if (any_sliding) sliding_mask_ = make_mask();
  // GptOssRotaryEmbedding.forward (no_grad): head_dim / 2 frequencies per position.
  const Wide half = static_cast<Wide>(a_.head_dim) / 2;
  T pf = g_.New(seq_, DT::kF32, false);
  T freqs = g_.New(seq_ * half, DT::kF32, false);
  g_.Drop(pf);
  T c = g_.New(seq_ * half, DT::kF32, false);
  T cs = g_.New(seq_ * half, DT::kF32, false);  // cos() * attention_scaling
  g_.Drop(c);
  T s = g_.New(seq_ * half, DT::kF32, false);
  T ss = g_.New(seq_ * half, DT::kF32, false);
  g_.Drop(s);
  g_.Drop(freqs);
  cos_ = Cast(g_, cs, dt);
  sin_ = Cast(g_, ss, dt);
  g_.Drop(cs);
  g_.Drop(ss);
}

T ModelRun::GptOssRotary(T x) {
  // _apply_rotary_emb: chunk, first * cos - second * sin, second * cos + first * sin, cat.
  std::vector<T> halves = Split(g_, x, 2);
  T m1 = Mul(g_, halves[0], cos_);
  T m2 = Mul(g_, halves[1], sin_);
  T first = Add(g_, m1, m2);  // a subtraction: the same memory
  g_.Drop(m1);
  g_.Drop(m2);
  T m3 = Mul(g_, halves[1], cos_);
  T m4 = Mul(g_, halves[0], sin_);
  T second = Add(g_, m3, m4);
  g_.Drop(m3);
  g_.Drop(m4);
  T out = Cat(g_, {first, second});
  g_.Drop(first);
  g_.Drop(second);
  g_.Drop(halves[0]);
  g_.Drop(halves[1]);
  return out;
}

T ModelRun::GptOssAttention(int layer, const BlockParams& bp, T h) {
  const Wide heads = static_cast<Wide>(a_.heads), kv = static_cast<Wide>(a_.kv_heads);
  const Wide d = static_cast<Wide>(a_.head_dim);
  T q = LoraLinear(bp.at(TensorRole::kAttentionQ), h);
  T k = LoraLinear(bp.at(TensorRole::kAttentionK), h);
  T v = LoraLinear(bp.at(TensorRole::kAttentionV), h);
  T qe = GptOssRotary(q);
  T ke = GptOssRotary(k);
  g_.Drop(q);
  g_.Drop(k);
  if (use_cache_) CacheUpdate(&ke, &v);
  // eager_attention_forward with the sinks.
  const Wide groups = heads / std::max<Wide>(kv, 1);
  T k2 = groups > 1 ? Copy(g_, ke, g_.Numel(ke) * groups) : g_.Alias(ke);
  T v2 = groups > 1 ? Copy(g_, v, g_.Numel(v) * groups) : g_.Alias(v);
  const Wide rows = batch_ * heads * seq_;
  T scores = AutocastBmm(g_, "Matmul(qk)", g_.Alias(qe), k2, rows * seq_);
  T scaled = Scale(g_, scores);
  g_.Drop(scores);
  T weights = Add(g_, scaled, LayerMask(layer));
  g_.Drop(scaled);
  // sinks.reshape(1, -1, 1, 1).expand(batch, -1, seq, -1): a view of the parameter.
  T sinks = g_.Alias(bp.sinks, rows, /*view=*/true);
  g_.Record(Graph::Spec("Expand(sinks)", {bp.sinks}, {sinks}));
  T combined = Cat(g_, {weights, sinks});
  g_.Drop(sinks);
  // combined.max(dim=-1, keepdim=True): values and int64 indices, the indices saved; its
  // backward scatters into zeros of combined's size.
  T mx = g_.New(rows, g_.Dtype(combined), g_.RequiresGrad(combined));
  T idx = g_.New(rows, DT::kI64, false);
  Graph::NodeSpec max_spec = Graph::Spec("Max", {combined}, {mx}, {idx});
  max_spec.extra = {{g_.Numel(combined), g_.Dtype(combined)}};
  g_.Record(std::move(max_spec));
  g_.Drop(idx);
  T shifted = Add(g_, combined, mx);  // combined - max: a subtraction, the same memory
  g_.Drop(combined);
  g_.Drop(mx);
  T probs = Softmax(g_, shifted, g_.Dtype(shifted));
  T kept = Slice(g_, probs, rows * seq_);  // probs[..., :-1]
  g_.Drop(probs);
  g_.Drop(weights);  // attn_weights is rebound to the dropout's result
  T dropped = Dropout(g_, kept, a_.attention_dropout);
  g_.Drop(kept);
  T pc = Cast(g_, dropped, g_.Dtype(v2));
  g_.Drop(dropped);
  T o = AutocastBmm(g_, "Matmul(pv)", pc, v2, rows * d);
  T out = Copy(g_, o);  // transpose(1, 2).contiguous()
  g_.Drop(o);
  g_.Drop(shifted);  // combined_logits, held until eager_attention_forward returns
  g_.Drop(qe);
  g_.Drop(ke);
  g_.Drop(v);
  T y = LoraLinear(bp.at(TensorRole::kAttentionOut), out);
  g_.Drop(out);
  return y;
}

// _grouped_linear: grouped_mm(input.to(weight.dtype), weight, offs), then out.add_(bias rows).
T ModelRun::GptOssGroupedLinear(T x, T w, T bias, T offs, Wide out) {
  const Wide rows = tokens_ * static_cast<Wide>(std::max<int64_t>(a_.experts_per_token, 1));
  T xin = Cast(g_, x, g_.Dtype(w));
  T y = g_.New(rows * out, g_.Dtype(w), true);
  g_.Record(Graph::Spec("GroupedMm", {xin, w}, {y}, {xin, offs}));
  g_.Drop(xin);
  // add_ in place: both gradients are the output's.
  T biased = g_.Alias(y, 0, /*view=*/true);
  g_.Record(Graph::Spec("Add_", {y, bias}, {biased}, {}, {true, true}));
  g_.Drop(y);
  return biased;
}

T ModelRun::GptOssMlp(const BlockParams& bp, T h) {
  const Wide k = static_cast<Wide>(std::max<int64_t>(a_.experts_per_token, 1));
  const Wide hw = static_cast<Wide>(a_.hidden);
  const Wide experts = static_cast<Wide>(a_.experts);
  const Wide S = tokens_ * k;
  // GptOssTopKRouter.forward.
  T logits = Linear(g_, h, bp.router.w, bp.router.b, hw, experts);
  T top = g_.New(S, g_.Dtype(logits), g_.RequiresGrad(logits));
  T top_idx = g_.New(S, DT::kI64, false);
  g_.Record(Graph::Spec("TopK", {logits}, {top}, {top_idx}));
  T scores = Softmax(g_, top, g_.Dtype(top));
  g_.Drop(top);
  // grouped_mm_experts_forward.
  T ids_g = g_.New(S, DT::kI64, false);  // torch.sort: the sorted ids and the permutation
  T perm = g_.New(S, DT::kI64, false);
  T src = g_.New(S, DT::kI64, false);  // perm // num_top_k
  T sel = g_.New(S * hw, g_.Dtype(h), g_.RequiresGrad(h));
  g_.Record(Graph::Spec("Index", {h}, {sel}, {src}));
  T weights = g_.New(S, g_.Dtype(scores), g_.RequiresGrad(scores));
  g_.Record(Graph::Spec("Index", {scores}, {weights}, {perm}));
  T hist_in = g_.New(S, DT::kI32, false);  // expert_ids_g.int() (.float() off CUDA)
  T hist = g_.New(experts, DT::kI32, false);
  T offs = g_.New(experts, DT::kI32, false);  // cumsum
  const T w_gu = bp.expert.at(TensorRole::kExpertGateUp);
  const T w_down = bp.expert.at(TensorRole::kExpertDown);
  const Wide gu_width = bp.expert_width.at(TensorRole::kExpertGateUp);
  const Wide ff = gu_width / 2;
  T gu_bias = g_.New(S * gu_width, g_.Dtype(w_gu), true);
  g_.Record(
      Graph::Spec("Index", {bp.expert_bias.at(TensorRole::kExpertGateUp)}, {gu_bias}, {ids_g}));
  T proj = GptOssGroupedLinear(sel, w_gu, gu_bias, offs, gu_width);
  // GptOssExperts._apply_gate.
  T gate = Slice(g_, proj, S * ff);
  T up = Slice(g_, proj, S * ff);
  auto clamp = [&](T x, int masks) {
    T y = g_.New(g_.Numel(x), g_.Dtype(x), g_.RequiresGrad(x));
    Graph::NodeSpec spec = Graph::Spec("Clamp", {x}, {y}, {x});
    // clamp_backward: where(self <= max [& self >= min], grad, 0) with its boolean masks.
    for (int i = 0; i < masks; ++i) spec.extra.emplace_back(g_.Numel(x), DT::kBool);
    g_.Record(std::move(spec));
    return y;
  };
  T gc = clamp(gate, 1);
  g_.Drop(gate);
  T uc = clamp(up, 2);
  g_.Drop(up);
  T ga = Scale(g_, gc);  // gate * alpha
  T sg = Apply(g_, Unary::kSigmoid, ga);
  g_.Drop(ga);
  T glu = Mul(g_, gc, sg);
  g_.Drop(sg);
  T u1 = Scale(g_, uc);  // up + 1
  T gated = Mul(g_, u1, glu);
  g_.Drop(u1);
  g_.Drop(glu);
  g_.Drop(gc);
  g_.Drop(uc);
  g_.Drop(proj);
  T down_bias = g_.New(S * hw, g_.Dtype(w_down), true);
  g_.Record(
      Graph::Spec("Index", {bp.expert_bias.at(TensorRole::kExpertDown)}, {down_bias}, {ids_g}));
  g_.Drop(gu_bias);  // selected_biases rebound
  T down = GptOssGroupedLinear(gated, w_down, down_bias, offs, hw);
  g_.Drop(gated);
  T weighted = Mul(g_, down, weights);
  // inv_perm = empty_like(perm); inv_perm[perm] = arange(S).
  T inv = g_.New(S, DT::kI64, false);
  T ar = g_.New(S, DT::kI64, false);
  g_.Drop(ar);
  T back = g_.New(S * hw, g_.Dtype(weighted), true);
  g_.Record(Graph::Spec("Index", {weighted}, {back}, {inv}));
  g_.Drop(weighted);
  T summed = g_.New(tokens_ * hw, g_.Dtype(back), true);
  g_.Record(Graph::Spec("Sum", {back}, {summed}));
  T out = Cast(g_, summed, g_.Dtype(h));
  g_.Drop(summed);
  for (T t : {back, down, down_bias, weights, inv, offs, hist, hist_in, sel, src, perm, ids_g}) {
    g_.Drop(t);
  }
  // GptOssMLP.forward returns: the router's logits, scores and indices go.
  g_.Drop(scores);
  g_.Drop(top_idx);
  g_.Drop(logits);
  return out;
}

}  // namespace memplan::estimator::step
