#include "estimator/step_blocks.h"

#include <algorithm>
#include <cstdint>

#include "estimator/step_ops.h"

namespace memplan::estimator::step {

bool ModelRun::Checkpointed(int layer) const {
  if (s_.checkpointing != Checkpointing::kFull) return false;
  const int64_t k = std::max<int64_t>(s_.checkpoint_every, 1);
  // Transformers' _set_gradient_checkpointing: `layer_index % every_n_layers == 0`.
  return layer % k == 0;
}

T ModelRun::BlockFor(int layer, T x) {
  switch (s_.framework) {
    case Framework::kTorchtune: return TorchtuneBlock(layer, x);
    case Framework::kLitGpt: return LitGptBlock(layer, x);
    case Framework::kLlmFoundry: return FoundryBlock(layer, x);
    case Framework::kTorchtitan: return TorchtitanBlock(layer, x);
    default: return enc_.on ? EncoderBlock(layer, x) : TransformersDecoderBlock(layer, x);
  }
}

T ModelRun::RunBlock(int layer, T x) {
  if (!Checkpointed(layer)) return BlockFor(layer, x);
  // torch.utils.checkpoint (use_reentrant=False): the forward keeps nothing of the block but
  // its input; the block's backward re-runs it first.
  g_.SetSaving(false);
  T out = BlockFor(layer, x);
  g_.SetSaving(true);
  // What the checkpoint keeps besides the input: the layer's keyword arguments (the rotary
  // tables, its mask, the position ids, Falcon's ALiBi tensor).
  g_.RecordCheckpoint(x, out, [this, layer](T in) { return BlockFor(layer, in); },
                      {cos_, sin_, LayerMask(layer), positions_, alibi_});
  return out;
}

T ModelRun::RunLayers(T x) {
  for (int64_t i = 0; i < a_.layers; ++i) {
    g_.SetWhere("layer " + std::to_string(i));
    T next = RunBlock(static_cast<int>(i), x);
    g_.Drop(x);
    x = next;
  }
  return x;
}

T ModelRun::AddLoss(T loss, T l) {
  if (!loss.ok()) return l;
  T sum = Add(g_, loss, l);
  g_.Drop(loss);
  g_.Drop(l);
  return sum;
}

// --- Transformers ----------------------------------------------------------------------------

T ModelRun::RmsNormalizedF32(const Norm& n, T x, Square square, T* variance) {
  // The part the RMSNorms share: x in fp32, times rsqrt(mean(x^2) + eps). Transformers':
  //   hidden_states = hidden_states.to(torch.float32)
  //   variance = hidden_states.pow(2).mean(-1, keepdim=True)
  //   hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
  // LitGPT's squares with x * x (LitGptRmsNorm).
  T h = Cast(g_, x, DT::kF32);
  T p = square == Square::kPow ? Apply(g_, Unary::kPow, h) : Mul(g_, h, h);
  T var = MeanRows(g_, p, n.width);
  g_.Drop(p);
  T eps = Scale(g_, var);
  if (variance != nullptr) {
    *variance = var;  // a local of the caller's forward: the caller drops it when that returns
  } else {
    g_.Drop(var);
  }
  T r = Apply(g_, Unary::kRsqrt, eps);
  g_.Drop(eps);
  T hn = Mul(g_, h, r);
  g_.Drop(h);
  g_.Drop(r);
  return hn;
}

T ModelRun::HfRmsNorm(const Norm& n, T x) {
  // LlamaRMSNorm.forward (transformers/models/llama/modeling_llama.py), and its copies:
  //   input_dtype = hidden_states.dtype
  //   hidden_states = hidden_states.to(torch.float32)
  //   variance = hidden_states.pow(2).mean(-1, keepdim=True)
  //   hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
  //   return self.weight * hidden_states.to(input_dtype)
  // hidden_states (the fp32 normalized x) and variance are locals until it returns.
  const DT in = g_.Dtype(x);
  T var;
  T hn = RmsNormalizedF32(n, x, Square::kPow, &var);
  T hc = Cast(g_, hn, in);
  T out = Mul(g_, n.w, hc);
  g_.Drop(hc);
  g_.Drop(hn);
  g_.Drop(var);
  return out;
}

T ModelRun::GemmaRmsNorm(const Norm& n, T x) {
  // GemmaRMSNorm.forward (models/gemma/modeling_gemma.py):
  //   output = self._norm(x.float())           # x * torch.rsqrt(x.pow(2).mean(-1) + eps)
  //   output = output * (1.0 + self.weight.float())
  //   return output.type_as(x)
  const DT in = g_.Dtype(x);
  T hn = RmsNormalizedF32(n, x);
  T wf = Cast(g_, n.w, DT::kF32);
  T w1 = Scale(g_, wf);  // 1.0 + weight
  g_.Drop(wf);
  T out = Mul(g_, hn, w1);
  g_.Drop(hn);
  g_.Drop(w1);
  T oc = Cast(g_, out, in);
  g_.Drop(out);
  return oc;
}

T ModelRun::OlmoRmsNorm(const Norm& n, T x) {
  // Olmo2RMSNorm.forward (models/olmo2/modeling_olmo2.py): the weight multiplied in fp32, then
  //   return (self.weight * hidden_states).to(input_dtype)
  // hidden_states and variance are locals until it returns.
  const DT in = g_.Dtype(x);
  T var;
  T hn = RmsNormalizedF32(n, x, Square::kPow, &var);
  T out = Mul(g_, n.w, hn);
  T oc = Cast(g_, out, in);
  g_.Drop(out);
  g_.Drop(hn);
  g_.Drop(var);
  return oc;
}

T ModelRun::NormAny(const Norm& n, T x) {
  switch (fam_.norm) {
    case Family::NormKind::kRms: return HfRmsNorm(n, x);
    case Family::NormKind::kRmsGemma: return GemmaRmsNorm(n, x);
    case Family::NormKind::kRmsOlmo: return OlmoRmsNorm(n, x);
    case Family::NormKind::kLayer: return LayerNorm(g_, x, n.w, n.b, n.width);
    case Family::NormKind::kCohere: return CohereLayerNorm(n, x, n.width);
    case Family::NormKind::kLayer1P: {
      // _cast_if_autocast_enabled: input, weight + 1 and bias to the autocast dtype (plain
      // copies: no weight cache), then F.layer_norm with autocast disabled.
      const bool ac = g_.autocast();
      auto cast = [&](T t) { return ac ? Cast(g_, t, g_.autocast_dtype()) : g_.Alias(t); };
      T w1 = Scale(g_, n.w);
      T xc = cast(x);
      T wc = cast(w1);
      g_.Drop(w1);
      T bc = n.b.ok() ? cast(n.b) : T{};
      g_.SetAutocast(false, g_.autocast_dtype());
      T y = LayerNorm(g_, xc, wc, bc, n.width);
      g_.SetAutocast(ac, g_.autocast_dtype());
      g_.Drop(xc);
      g_.Drop(wc);
      g_.Drop(bc);
      return y;
    }
    case Family::NormKind::kLayerNoParams: {
      T x32 = Cast(g_, x, DT::kF32);
      T y = LayerNorm(g_, x32, T{}, T{}, n.width);
      g_.Drop(x32);
      T out = Cast(g_, y, g_.Dtype(x));
      g_.Drop(y);
      return out;
    }
  }
  return g_.Alias(x);
}

T ModelRun::CohereLayerNorm(const Norm& n, T x, Wide width) {
  T x32 = Cast(g_, x, DT::kF32);
  T mean = MeanRows(g_, x32, width);
  T centred = Add(g_, x32, mean);  // for the variance
  T sq = Apply(g_, Unary::kPow, centred);
  g_.Drop(centred);
  T var = MeanRows(g_, sq, width);
  g_.Drop(sq);
  T eps = Scale(g_, var);
  g_.Drop(var);
  T r = Apply(g_, Unary::kRsqrt, eps);
  g_.Drop(eps);
  T centred2 = Add(g_, x32, mean);  // computed again for the product
  g_.Drop(x32);
  g_.Drop(mean);
  T normed = Mul(g_, centred2, r);
  g_.Drop(centred2);
  g_.Drop(r);
  T w32 = Cast(g_, n.w, DT::kF32);
  T y = Mul(g_, w32, normed);
  g_.Drop(w32);
  g_.Drop(normed);
  T out = Cast(g_, y, g_.Dtype(x));
  g_.Drop(y);
  return out;
}

T ModelRun::RotateHalf(T x) { return RotateHalf(x, cos_, sin_); }

T ModelRun::RotateHalf(T x, T cos, T sin) {
  // x * cos + rotate_half(x) * sin with the tables of this forward (or the caller's),
  // rotate_half = cat(-x2, x1) over the halves of x (all of it rotated).
  T m1 = Mul(g_, x, cos);
  T x1 = Slice(g_, x, g_.Numel(x) / 2);
  T x2 = Slice(g_, x, g_.Numel(x) / 2);
  T n = Apply(g_, Unary::kNeg, x2);
  g_.Drop(x2);
  T c = Cat(g_, {n, x1});
  g_.Drop(n);
  g_.Drop(x1);
  T m2 = Mul(g_, c, sin);
  g_.Drop(c);
  T out = Add(g_, m1, m2);
  g_.Drop(m1);
  g_.Drop(m2);
  return out;
}

T ModelRun::ApplyRotary(T x) {
  // apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, rotate_half = cat(-x2, x1); over the
  // first rotary_dims of each head only when partial (Phi, GPT-NeoX: rotated part cat with the
  // rest).
  const Wide d = static_cast<Wide>(a_.head_dim);
  const Wide rd = fam_.rotary_dims == 0 || fam_.rotary_dims >= d ? d : fam_.rotary_dims;
  T rot = rd == d ? g_.Alias(x) : Slice(g_, x, g_.Numel(x) / d * rd);
  T out = RotateHalf(rot);
  g_.Drop(rot);
  if (rd == d) return out;
  T pass = Slice(g_, x, g_.Numel(x) / d * (d - rd));
  T full = Cat(g_, {out, pass});
  g_.Drop(out);
  g_.Drop(pass);
  return full;
}

T ModelRun::Activation(T x) {
  switch (fam_.act) {
    case Family::Act::kSilu: return Apply(g_, Unary::kSilu, x);
    case Family::Act::kGelu: return Apply(g_, Unary::kGelu, x);
    case Family::Act::kGeluTanh: return Apply(g_, Unary::kGeluTanh, x);
    case Family::Act::kRelu: return Apply(g_, Unary::kRelu, x);
    case Family::Act::kRelu2: {
      T r = Apply(g_, Unary::kRelu, x);
      T sq = Apply(g_, Unary::kPow, r);
      g_.Drop(r);
      return sq;
    }
    case Family::Act::kGeluNew: {
      // NewGELUActivation (transformers/activations.py), a Python formula:
      //   0.5 * input * (1.0 + torch.tanh(sqrt(2 / pi) * (input + 0.044715 * input ** 3)))
      T p = Apply(g_, Unary::kPow, x);  // an fp32 op under autocast: saves the fp32 copy
      T m1 = Scale(g_, p);
      g_.Drop(p);
      T a1 = Add(g_, x, m1);
      g_.Drop(m1);
      T m2 = Scale(g_, a1);
      g_.Drop(a1);
      T t = Apply(g_, Unary::kTanh, m2);
      g_.Drop(m2);
      T a2 = Scale(g_, t);  // 1.0 + tanh(...)
      g_.Drop(t);
      T half = Scale(g_, x);  // 0.5 * input
      T out = Mul(g_, half, a2);
      g_.Drop(half);
      g_.Drop(a2);
      return out;
    }
  }
  return g_.Alias(x);
}

T ModelRun::LoraLinear(const Lin& l, T x) {
  T y = l.matmul ? MatmulThenBias(g_, x, l.w, l.b, l.in, l.out)
                 : Linear(g_, x, l.w, l.b, l.in, l.out);
  if (!l.lora_a.ok()) return y;
  // PEFT's lora.Linear.forward: result + lora_B(lora_A(dropout(x))) * scaling.
  const Wide r = static_cast<Wide>(s_.lora_rank);
  T xc = Cast(g_, x, g_.Dtype(l.lora_a));
  T xa = Dropout(g_, xc, s_.LoraDropout());
  g_.Drop(xc);
  T ya = Linear(g_, xa, l.lora_a, T{}, l.in, r);
  g_.Drop(xa);
  T yb = Linear(g_, ya, l.lora_b, T{}, r, l.out);
  g_.Drop(ya);
  T ys = Scale(g_, yb);
  g_.Drop(yb);
  T sum = Add(g_, y, ys);
  g_.Drop(y);
  g_.Drop(ys);
  return sum;
}

T ModelRun::BloomAttention(const BlockParams& bp, T h) {
  // BloomAttention.forward (models/bloom/modeling_bloom.py): the fused projection viewed as
  // query, key and value, the cache update, reshape to (batch x heads) x seq x head_dim (a copy
  // of the strided query), alibi.baddbmm(q, k^T), + mask, softmax in fp32 cast back, dropout,
  // bmm with v, _merge_heads (a copy), dense.
  const Wide heads = static_cast<Wide>(a_.heads), d = static_cast<Wide>(a_.head_dim);
  T qkv = LoraLinear(bp.at(TensorRole::kAttentionQkv), h);
  const Wide n = tokens_ * heads * d;
  T q = Slice(g_, qkv, n), k = Slice(g_, qkv, n), v = Slice(g_, qkv, n);
  g_.Drop(qkv);
  if (use_cache_) CacheUpdate(&k, &v);
  T qr = Copy(g_, q);  // reshape of the strided view
  g_.Drop(q);
  T kr = use_cache_ ? g_.Alias(k) : Copy(g_, k);
  T vr = use_cache_ ? g_.Alias(v) : Copy(g_, v);
  g_.Drop(k);
  g_.Drop(v);
  T scores = AutocastBmm(g_, "Baddbmm", qr, kr, batch_ * heads * seq_ * seq_);
  T masked = Add(g_, scores, mask_);
  g_.Drop(scores);
  T probs = Softmax(g_, masked, DT::kF32);
  g_.Drop(masked);
  T pc = Cast(g_, probs, autocast_ ? adt_ : g_.Dtype(vr));
  g_.Drop(probs);
  T dropped = Dropout(g_, pc, a_.attention_dropout);
  g_.Drop(pc);
  T o = AutocastBmm(g_, "Bmm(pv)", dropped, vr, batch_ * heads * seq_ * d);
  T merged = Copy(g_, o);
  g_.Drop(o);
  T out = LoraLinear(bp.at(TensorRole::kAttentionOut), merged);
  g_.Drop(merged);
  return out;
}

// The query, key and value as the attention module makes them: the projections (one fused or
// three), OPT's query scaling, the query/key norms, rotary, and the DynamicCache copies.
ModelRun::QkvViews ModelRun::TransformersQkv(int layer, const BlockParams& bp, T h) {
  const Wide heads = static_cast<Wide>(a_.heads), kv = static_cast<Wide>(a_.kv_heads);
  const Wide d = static_cast<Wide>(a_.head_dim);
  T q, k, v;
  if (bp.has(TensorRole::kAttentionQkv)) {
    // One projection split into query, key and value views (GPT-2's c_attn .split, Phi-3's
    // qkv[..., :q], GPT-NeoX's chunk): the views keep the whole output alive.
    T qkv = LoraLinear(bp.at(TensorRole::kAttentionQkv), h);
    const Wide qn = tokens_ * heads * d, kn = tokens_ * kv * d;
    q = Slice(g_, qkv, qn);
    k = Slice(g_, qkv, kn);
    v = Slice(g_, qkv, kn);
    g_.Drop(qkv);
  } else {
    q = LoraLinear(bp.at(TensorRole::kAttentionQ), h);
    k = LoraLinear(bp.at(TensorRole::kAttentionK), h);
    v = LoraLinear(bp.at(TensorRole::kAttentionV), h);
  }
  if (a_.clip_qkv) {
    // OlmoAttention: query_states.clamp_(...), key and value likewise, before the views.
    q = ClampInPlace(q);
    k = ClampInPlace(k);
    v = ClampInPlace(v);
  }
  if (fam_.query_scaled) {
    T qs = Scale(g_, q);  // OPTAttention: q_proj(hidden_states) * self.scaling
    g_.Drop(q);
    q = qs;
  }
  auto qk_norms = [&] {
    if (fam_.qk_norm == Family::QkNorm::kCohere) {
      if (bp.qk_norms.size() < 2) return;
      T qn = CohereLayerNorm(bp.qk_norms[0], q, d);
      g_.Drop(q);
      q = qn;
      T kn = CohereLayerNorm(bp.qk_norms[1], k, d);
      g_.Drop(k);
      k = kn;
      return;
    }
    if (fam_.qk_norm == Family::QkNorm::kPerHeadLayer) {
      if (bp.qk_norms.size() < static_cast<size_t>(heads + kv)) return;
      // StableLmLayerNormPerHead: torch.split(x, 1, dim=1) into per-head views, each through
      // its own LayerNorm, then torch.cat of the outputs.
      auto per_head = [&](T x, size_t first, Wide n) {
        std::vector<T> parts = Split(g_, x, n);
        std::vector<T> outs;
        for (Wide i = 0; i < n; ++i) {
          const Norm& nm = bp.qk_norms[first + static_cast<size_t>(i)];
          outs.push_back(LayerNorm(g_, parts[static_cast<size_t>(i)], nm.w, nm.b, d));
          g_.Drop(parts[static_cast<size_t>(i)]);
        }
        T cat = Cat(g_, outs);
        for (T o : outs) g_.Drop(o);
        return cat;
      };
      T qn = per_head(q, 0, heads);
      g_.Drop(q);
      q = qn;
      T kn = per_head(k, static_cast<size_t>(heads), kv);
      g_.Drop(k);
      k = kn;
      return;
    }
    if (fam_.qk_norm == Family::QkNorm::kNone || bp.qk_norms.size() < 2) return;
    // Olmo2RMSNorm for OLMo 2's and 3's q_norm and k_norm too (the product cast to the input's
    // dtype), LlamaRMSNorm's otherwise.
    auto norm = [&](const Norm& n, T t) {
      if (fam_.qk_norm == Family::QkNorm::kHeadLayer) return LayerNorm(g_, t, n.w, n.b, n.width);
      return fam_.norm == Family::NormKind::kRmsOlmo ? OlmoRmsNorm(n, t) : HfRmsNorm(n, t);
    };
    T qn = norm(bp.qk_norms[0], q);
    g_.Drop(q);
    q = qn;
    T kn = norm(bp.qk_norms[1], k);
    g_.Drop(k);
    k = kn;
  };
  if (!fam_.qk_norm_after_rotary) qk_norms();
  // SmolLM3Attention: `if self.use_rope` (its NoPE layers rotate nothing).
  const auto& nope = a_.nope_layers;
  const bool nope_layer = static_cast<size_t>(layer) < nope.size() && nope[layer];
  if (fam_.rotary && !nope_layer) {
    // ERNIE 4.5's apply_rotary_pos_emb: its interleaved tables, made for q and k together.
    T icos, isin;
    if (fam_.ernie_rotary || fam_.interleaved_tables) {
      icos = g_.New(g_.Numel(cos_), g_.Dtype(cos_), false);
      isin = g_.New(g_.Numel(sin_), g_.Dtype(sin_), false);
    }
    auto ernie = [&](T x) {
      T x32 = Cast(g_, x, DT::kF32);
      T m1 = Mul(g_, x32, icos);
      g_.Drop(x32);
      T x1 = Slice(g_, x, g_.Numel(x) / 2);
      T x2 = Slice(g_, x, g_.Numel(x) / 2);
      T n = Apply(g_, Unary::kNeg, x2);
      g_.Drop(x2);
      T c = Cat(g_, {n, x1});  // stack + flatten: the same bytes
      g_.Drop(n);
      g_.Drop(x1);
      T c32 = Cast(g_, c, DT::kF32);
      g_.Drop(c);
      T m2 = Mul(g_, c32, isin);
      g_.Drop(c32);
      T out = Add(g_, m1, m2);
      g_.Drop(m1);
      g_.Drop(m2);
      T back = Cast(g_, out, g_.Dtype(x));
      g_.Drop(out);
      return back;
    };
    // OLMo's apply_rotary_pos_emb returns q_embed.to(q.dtype): the fp32 tables promote the
    // rotation to fp32, cast back here rather than kept for the cache and SDPA (Cohere's too,
    // which rotates fp32 copies of q and k).
    auto rotated = [&](T x) {
      if (fam_.ernie_rotary) return ernie(x);
      if (fam_.interleaved_tables) return RotateHalf(x, icos, isin);
      T up = fam_.rotary_upcast_first ? Cast(g_, x, DT::kF32) : g_.Alias(x);
      T r = ApplyRotary(up);
      g_.Drop(up);
      if (!fam_.rotary_cast_back) return r;
      T back = Cast(g_, r, g_.Dtype(x));
      g_.Drop(r);
      return back;
    };
    T qr = rotated(q);
    g_.Drop(q);
    q = qr;
    T kr = rotated(k);
    g_.Drop(k);
    k = kr;
    g_.Drop(icos);
    g_.Drop(isin);
  }
  if (fam_.qk_norm_after_rotary) qk_norms();
  // DynamicCache.update in training (use_cache from the config): the first update cats onto an
  // empty tensor of the key's dtype, copying key and value (the value promoted to it).
  if (use_cache_) CacheUpdate(&k, &v);
  return {q, k, v};
}

// sdpa_attention_forward: the backend SDPA picks, grouped k/v repeated when a mask is explicit
// (as.mask; replacing t->k and t->v with their copies), the mask made per call.
T ModelRun::TransformersSdpa(AttentionShape as, DT cdt, QkvViews* t) {
  const Wide heads = static_cast<Wide>(a_.heads), kv = static_cast<Wide>(a_.kv_heads);
  const T q = t->q;
  T& k = t->k;
  T& v = t->v;
  T out;
  SdpaBackend backend;
  const int sm = s_.GpuSm();
  const bool half = Half(cdt);
  if (!half) {
    backend = SdpaBackend::kEfficient;
  } else if (as.mask) {
    backend = sm >= 80 || cdt == DT::kF16 ? SdpaBackend::kEfficient : SdpaBackend::kMath;
  } else if (sm >= 90 && sm < 110) {
    backend = SdpaBackend::kCudnn;
  } else if (sm >= 80 && as.head_dim == as.v_head_dim) {
    // sdp_utils.cpp check_head_dim_size_flash: query, key and value heads of one width.
    backend = SdpaBackend::kFlash;
  } else if (sm >= 80) {
    backend = SdpaBackend::kEfficient;
  } else {
    backend = cdt == DT::kF16 ? SdpaBackend::kEfficient : SdpaBackend::kMath;
  }
  // sdpa_attention_forward: grouped keys and values go to SDPA as they are (enable_gqa) when
  // there is no mask (use_gqa_in_sdpa); otherwise repeat_kv copies them to every head.
  // With one key/value head repeat_kv's result is a view (RepeatKv); SDPA's kernels then take
  // every head's keys and values as memory of their own, so the copy is made either way (the
  // traced Gemma-3 points say so).
  if (kv != heads && as.mask) {
    T k2 = Copy(g_, k, g_.Numel(k) * (heads / kv));
    g_.Drop(k);
    k = k2;
    T v2 = Copy(g_, v, g_.Numel(v) * (heads / kv));
    g_.Drop(v);
    v = v2;
    as.kv_heads = heads;
  }
  T qc = AutocastIn(g_, q), kc = AutocastIn(g_, k), vc = AutocastIn(g_, v);
  T mask;
  if (fam_.falcon_alibi) {
    // The float ALiBi mask, cast by SDPA's autocast kernel (a copy per call under autocast).
    mask = AutocastIn(g_, mask_);
  } else if (as.mask && backend != SdpaBackend::kFlash) {
    // The boolean mask made additive in the query's dtype for the fused kernel, per call.
    mask = g_.New(batch_ * seq_ * seq_, cdt, false);
  }
  out = Sdpa(g_, backend, qc, kc, vc, as, mask);
  g_.Drop(mask);
  g_.Drop(qc);
  g_.Drop(kc);
  g_.Drop(vc);
  // A partial rotation cats the rotated and passed parts of each head: the query is
  // heads-major.
  const bool partial_rotary =
      fam_.rotary && fam_.rotary_dims > 0 && fam_.rotary_dims < static_cast<Wide>(a_.head_dim);
  return SeqMajor(out, backend, partial_rotary);
}

T ModelRun::SeqMajor(T out, SdpaBackend backend, bool heads_major_query) {
  // transpose(1, 2) then contiguous() or reshape() copies unless the output is laid out
  // batch x seq x heads x d: the math composite's never is; flash attention's follows the
  // query's layout.
  if (backend != SdpaBackend::kMath && !(backend == SdpaBackend::kFlash && heads_major_query)) {
    return out;
  }
  T copy = Copy(g_, out);
  g_.Drop(out);
  return copy;
}

T ModelRun::ClampInPlace(T x) {
  if (!g_.RequiresGrad(x)) return x;
  T before = Copy(g_, x);
  T out = g_.New(g_.Numel(x), g_.Dtype(x), true);
  g_.Record(Graph::Spec("Clamp", {x}, {out}, {before}));
  g_.Drop(x);
  g_.Drop(before);
  return out;
}

T ModelRun::RepeatKv(T x) {
  // repeat_kv: x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d). The
  // reshape copies unless there is one key/value head (multi-query: GPT-BigCode, Falcon-7B),
  // whose size-1 dimension merges with the expanded one into a view.
  const Wide heads = static_cast<Wide>(a_.heads), kv = static_cast<Wide>(a_.kv_heads);
  if (kv == heads || kv <= 1) return x;
  T copy = Copy(g_, x, g_.Numel(x) * (heads / kv));
  g_.Drop(x);
  return copy;
}

T ModelRun::TransformersEagerAttention(const QkvViews& t) {
  const Wide heads = static_cast<Wide>(a_.heads);
  const Wide d = static_cast<Wide>(a_.head_dim);
  const T q = t.q, k = t.k, v = t.v;
  T out;
  // eager_attention_forward: repeat_kv, q @ k^T * scaling, + mask, softmax (fp32), cast back,
  // dropout, @ v, transpose(1, 2).contiguous().
  T k2 = RepeatKv(g_.Alias(k));
  T v2 = RepeatKv(g_.Alias(v));
  T q32, k32;  // GPT-J's: under autocast the matmul casts them back to 16 bits
  if (fam_.qk_fp32) {
    q32 = Cast(g_, q, DT::kF32);
    k32 = Cast(g_, k2, DT::kF32);
    g_.Drop(k2);
    k2 = g_.Alias(k32);
  }
  T scores = AutocastBmm(g_, "Matmul(qk)", q32.ok() ? g_.Alias(q32) : g_.Alias(q), k2,
                         batch_ * heads * seq_ * seq_);
  T scaled = Scale(g_, scores);
  g_.Drop(scores);
  if (a_.attn_softcap > 0) {
    // Gemma-2: scores / softcap, tanh, * softcap.
    T d1 = Scale(g_, scaled);
    g_.Drop(scaled);
    T th = Apply(g_, Unary::kTanh, d1);
    g_.Drop(d1);
    scaled = Scale(g_, th);
    g_.Drop(th);
  }
  T masked = Add(g_, scaled, mask_);
  g_.Drop(scaled);
  // Llama's: softmax(..., dtype=torch.float32).to(query.dtype); GPT-2's: softmax(...) (an fp32
  // op under autocast), .type(value.dtype).
  T probs = Softmax(g_, masked, fam_.probs_to_value ? g_.Dtype(masked) : DT::kF32);
  g_.Drop(masked);
  T pc = Cast(g_, probs, fam_.probs_to_value ? g_.Dtype(v2) : g_.Dtype(q));
  g_.Drop(probs);
  T dropped = Dropout(g_, pc, a_.attention_dropout);
  g_.Drop(pc);
  T o = AutocastBmm(g_, "Matmul(pv)", dropped, v2, batch_ * heads * seq_ * d);
  out = Copy(g_, o);
  g_.Drop(o);
  g_.Drop(q32);
  g_.Drop(k32);
  return out;
}

// create_sliding_window_causal_mask: with no padding SDPA may still skip the mask while the keys
// fit in the window (_ignore_causal_mask_sdpa), not once they reach it.
bool ModelRun::SlidingMasked(int layer) const {
  const auto& sliding = a_.sliding_layers;
  const auto i = static_cast<size_t>(layer);
  return a_.sliding_window > 0 && i < sliding.size() && sliding[i] &&
         seq_ >= static_cast<Wide>(a_.sliding_window);
}

bool ModelRun::AnySlidingMasked() const {
  for (int64_t i = 0; i < a_.layers; ++i) {
    if (SlidingMasked(static_cast<int>(i))) return true;
  }
  return false;
}

T ModelRun::TransformersAttention(int layer, const BlockParams& bp, T h) {
  if (fam_.gpt_oss) return GptOssAttention(layer, bp, h);
  if (fam_.bloom_attention) return BloomAttention(bp, h);
  if (fam_.mla) return MlaAttention(bp, h);
  const Wide heads = static_cast<Wide>(a_.heads), kv = static_cast<Wide>(a_.kv_heads);
  const Wide d = static_cast<Wide>(a_.head_dim);
  QkvViews t = TransformersQkv(layer, bp, h);
  AttentionShape as = SelfAttentionShape(heads, kv, d);
  as.dropout = a_.attention_dropout;
  // A sliding-window layer's SDPA takes the mask (the model's other layers may run causal).
  as.mask = explicit_mask_ || SlidingMasked(layer);
  const DT cdt = autocast_ ? adt_ : g_.Dtype(t.q);
  T out = sdpa_ ? TransformersSdpa(as, cdt, &t) : TransformersEagerAttention(t);
  g_.Drop(t.q);
  g_.Drop(t.k);
  g_.Drop(t.v);
  T o = LoraLinear(bp.at(TensorRole::kAttentionOut), out);
  g_.Drop(out);
  return o;
}

T ModelRun::TransformersMoe(const BlockParams& bp, T h) {
  // The sparse MoE block of Transformers >= 5 (MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock,
  // Qwen3MoeSparseMoeBlock): the router (a Linear, softmax in fp32, top-k), then the experts
  // through integrations/moe.py grouped_mm_experts_forward: the tokens gathered k times in
  // expert order, one grouped matmul into gate and up, act(gate) * up, one into down, weighted,
  // gathered back and summed over k; Qwen2-MoE adds its shared expert behind a sigmoid gate.
  if (fam_.gpt_oss) return GptOssMlp(bp, h);
  const Wide k = static_cast<Wide>(std::max<int64_t>(a_.experts_per_token, 1));
  const Wide hw = static_cast<Wide>(a_.hidden);
  const Wide experts = static_cast<Wide>(a_.experts);
  // Qwen2MoeSparseMoeBlock runs its shared expert first, before the router.
  const bool shared_first = bp.has(TensorRole::kSharedExpertGate);
  T shared = shared_first ? TransformersMlp(bp, h) : T{};
  Routing r = fam_.v3_router ? DeepseekV3Router(bp, h)
              : fam_.mla     ? DeepseekV2Router(bp, h)
                             : TransformersRouter(bp, h);
  const Wide S = tokens_ * k;
  // expert_ids_g, perm = sort(expert_ids); selected_hidden_states_g = hidden_states[perm // k]
  // (the quotient a temporary that IndexBackward keeps); sample_weights_g = weights[perm].
  T ids_sorted = g_.New(S, DT::kI64, false);
  T perm = g_.New(S, DT::kI64, false);
  T src = g_.New(S, DT::kI64, false);
  T sel = g_.New(S * hw, g_.Dtype(h), g_.RequiresGrad(h));
  g_.Record(Graph::Spec("Index", {h}, {sel}, {src}));
  g_.Drop(src);
  T weights = g_.New(S, g_.Dtype(r.weights), g_.RequiresGrad(r.weights));
  g_.Record(Graph::Spec("Index", {r.weights}, {weights}, {perm}));
  // histc over the sorted ids (as int32 on CUDA), its counts and their cumsum: the offsets.
  T histc_in = g_.New(S, DT::kI32, false);
  T per_expert = g_.New(experts, DT::kI32, false);
  T offs = g_.New(experts, DT::kI32, false);
  const bool gated = bp.expert.count(TensorRole::kExpertGateUp) > 0;
  const T w_in =
      gated ? bp.expert.at(TensorRole::kExpertGateUp) : bp.expert.at(TensorRole::kExpertUp);
  const Wide in_width = gated ? bp.expert_width.at(TensorRole::kExpertGateUp)
                              : bp.expert_width.at(TensorRole::kExpertUp);
  // torch._grouped_mm saves its input for the weight's gradient only when the weight trains
  // (LoRA freezes the experts); the input, selected_hidden_states_g, stays a local of
  // grouped_mm_experts_forward until it returns either way.
  const bool experts_train = g_.RequiresGrad(w_in);
  T proj = g_.New(S * in_width, g_.Dtype(sel), true);
  g_.Record(Graph::Spec("GroupedMm", {sel, w_in}, {proj},
                        experts_train ? std::vector<T>{sel, offs} : std::vector<T>{offs}));
  T act;
  if (gated) {
    T gate = Slice(g_, proj, g_.Numel(proj) / 2);
    T up = Slice(g_, proj, g_.Numel(proj) / 2);
    T ag = Activation(gate);
    g_.Drop(gate);
    act = Mul(g_, ag, up);
    g_.Drop(ag);
    g_.Drop(up);
  } else {
    act = Activation(proj);
  }
  g_.Drop(proj);
  const T w_out = bp.expert.at(TensorRole::kExpertDown);
  T down = g_.New(S * hw, g_.Dtype(act), true);
  g_.Record(Graph::Spec("GroupedMm", {act, w_out}, {down},
                        g_.RequiresGrad(w_out) ? std::vector<T>{act, offs} : std::vector<T>{offs}));
  g_.Drop(act);
  T weighted = Mul(g_, down, weights);
  // inv_perm = empty_like(perm); inv_perm[perm] = arange(S); weighted_out[inv_perm].
  T inv = g_.New(S, DT::kI64, false);
  T arange = g_.New(S, DT::kI64, false);
  g_.Drop(arange);
  T back = g_.New(S * hw, g_.Dtype(weighted), true);
  g_.Record(Graph::Spec("Index", {weighted}, {back}, {inv}));
  g_.Drop(weighted);
  T summed = g_.New(tokens_ * hw, g_.Dtype(back), true);
  g_.Record(Graph::Spec("Sum", {back}, {summed}));
  // final_hidden_states.to(hidden_states.dtype): fp32 routing weights (DeepSeek's) promote.
  T out = Cast(g_, summed, g_.Dtype(h));
  g_.Drop(summed);
  // grouped_mm_experts_forward's locals go when it returns: the gathered-back rows
  // (weighted_out), the down projection's output (proj_out, never reassigned after it), the
  // selected rows and weights, and the indices and counts.
  for (T local : {back, down, sel, weights, ids_sorted, perm, histc_in, per_expert, offs, inv}) {
    g_.Drop(local);
  }
  if (bp.has(TensorRole::kMlpDown)) {
    // The shared expert: a dense MLP every token passes, Qwen2-MoE's behind sigmoid(gate(x)).
    if (!shared_first) shared = TransformersMlp(bp, h);
    if (bp.has(TensorRole::kSharedExpertGate)) {
      T gl = LoraLinear(bp.at(TensorRole::kSharedExpertGate), h);
      T sg = Apply(g_, Unary::kSigmoid, gl);
      g_.Drop(gl);
      T gated_shared = Mul(g_, sg, shared);
      g_.Drop(sg);
      g_.Drop(shared);
      shared = gated_shared;
    }
    T sum = Add(g_, out, shared);
    g_.Drop(out);
    g_.Drop(shared);
    out = sum;
  }
  g_.Drop(r.logits);
  g_.Drop(r.weights);
  g_.Drop(r.indices);
  return out;
}

// The router of Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE: a Linear, softmax in fp32, top-k;
// Mixtral's always normalizes the top-k weights and keeps them in fp32, the others normalize
// when norm_topk_prob and cast them to the logits' dtype.
ModelRun::Routing ModelRun::TransformersRouter(const BlockParams& bp, T h) {
  T logits =
      Linear(g_, h, bp.router.w, T{}, static_cast<Wide>(a_.hidden), static_cast<Wide>(a_.experts));
  if (inv_.model_type == "granitemoe") {
    // GraniteMoeTopKRouter: F.linear(...).float(), topk of the logits, softmax over the top k
    // (which saves its result), type_as the hidden states.
    const Wide k = static_cast<Wide>(std::max<int64_t>(a_.experts_per_token, 1));
    Routing r;
    r.logits = Cast(g_, logits, DT::kF32);
    g_.Drop(logits);
    T top = g_.New(tokens_ * k, DT::kF32, g_.RequiresGrad(r.logits));
    r.indices = g_.New(tokens_ * k, DT::kI64, false);
    g_.Record(Graph::Spec("TopK", {r.logits}, {top}, {r.indices}));
    T probs = Softmax(g_, top, DT::kF32);
    g_.Drop(top);
    r.weights = Cast(g_, probs, g_.Dtype(h));
    g_.Drop(probs);
    return r;
  }
  Routing r = TopKRouting(logits);
  const bool mixtral = inv_.model_type == "mixtral";
  if (mixtral || a_.norm_topk_prob) r.weights = NormalizeTopK(r.weights, /*epsilon=*/false);
  if (!mixtral && g_.Dtype(r.weights) != g_.Dtype(r.logits)) {
    T cast = Cast(g_, r.weights, g_.Dtype(r.logits));
    g_.Drop(r.weights);
    r.weights = cast;
  }
  return r;
}

ModelRun::Routing ModelRun::TopKRouting(T logits) {
  const Wide k = static_cast<Wide>(std::max<int64_t>(a_.experts_per_token, 1));
  Routing r;
  r.logits = logits;
  T probs = Softmax(g_, logits, DT::kF32);
  r.weights = g_.New(tokens_ * k, DT::kF32, g_.RequiresGrad(probs));
  r.indices = g_.New(tokens_ * k, DT::kI64, false);
  g_.Record(Graph::Spec("TopK", {probs}, {r.weights}, {r.indices}));
  g_.Drop(probs);
  return r;
}

T ModelRun::NormalizeTopK(T weights, bool epsilon) {
  // The sum is an fp32 op under autocast. The division is in place: DivBackward keeps the
  // divisor and a clone of the weights before it.
  const Wide k = static_cast<Wide>(std::max<int64_t>(a_.experts_per_token, 1));
  T in = Fp32In(g_, weights);
  T den = MeanRows(g_, in, k);
  g_.Drop(in);
  if (epsilon) {
    T plus = Scale(g_, den);
    g_.Drop(den);
    den = plus;
  }
  T before = Copy(g_, weights);
  T divided = g_.New(g_.Numel(weights), g_.Dtype(weights), g_.RequiresGrad(weights));
  g_.Record(Graph::Spec("Div", {weights, den}, {divided}, {den, before}));
  g_.Drop(weights);
  g_.Drop(den);
  g_.Drop(before);
  return divided;
}

void ModelRun::CacheUpdate(T* key, T* value) {
  T kc = Copy(g_, *key);
  g_.Drop(*key);
  *key = kc;
  T vc = g_.Dtype(*value) == g_.Dtype(kc) ? Copy(g_, *value) : Cast(g_, *value, g_.Dtype(kc));
  g_.Drop(*value);
  *value = vc;
  cache_.push_back(g_.Alias(*key));
  cache_.push_back(g_.Alias(*value));
}

T ModelRun::TransformersMlp(const BlockParams& bp, T h) {
  if (bp.has(TensorRole::kMlpGateUp)) {
    // Phi3MLP.forward: gate, up = gate_up_proj(x).chunk(2); down_proj(up * act(gate)).
    T gu = LoraLinear(bp.at(TensorRole::kMlpGateUp), h);
    T gate = Slice(g_, gu, g_.Numel(gu) / 2);
    T up = Slice(g_, gu, g_.Numel(gu) / 2);
    g_.Drop(gu);
    T ag = Activation(gate);
    g_.Drop(gate);
    T m = Mul(g_, up, ag);
    g_.Drop(ag);
    g_.Drop(up);
    T down = LoraLinear(bp.at(TensorRole::kMlpDown), m);
    g_.Drop(m);
    return down;
  }
  if (fam_.gated) {
    // LlamaMLP.forward: down_proj(act_fn(gate_proj(x)) * up_proj(x)).
    T gate = LoraLinear(bp.at(TensorRole::kMlpGate), h);
    T ag = Activation(gate);
    g_.Drop(gate);
    T up = LoraLinear(bp.at(TensorRole::kMlpUp), h);
    T m = Mul(g_, ag, up);
    g_.Drop(ag);
    g_.Drop(up);
    T down = LoraLinear(bp.at(TensorRole::kMlpDown), m);
    g_.Drop(m);
    return down;
  }
  // fc1 / c_fc / dense_h_to_4h, the activation, fc2 / c_proj / dense_4h_to_h.
  T up = LoraLinear(bp.at(TensorRole::kMlpUp), h);
  T a = Activation(up);
  g_.Drop(up);
  T down = LoraLinear(bp.at(TensorRole::kMlpDown), a);
  g_.Drop(a);
  return down;
}

T ModelRun::BodyAdd(T a, T b) {
  // The layer's own residual sums (Note [The recompute's own ops] in step_graph.cc).
  g_.SetBlockBody(true);
  T sum = Add(g_, a, b);
  g_.SetBlockBody(false);
  return sum;
}

void ModelRun::HoldEmbeddingLeaf(T t) {
  // Note [The frozen embedding's leaf] (TransformersForward).
  if (s_.checkpointing != Checkpointing::kFull || g_.RequiresGrad(t)) return;
  g_.SetRequiresGrad(t, true);
  // A leaf now: where the first op casts it to the autocast dtype (a post-norm block's
  // projections), the cast stays in autocast's cache until the forward's region ends.
  g_.MarkLeaf(t);
  T held = g_.Alias(t);
  g_.RecordHook([this, held] { g_.Drop(held); });
}

T ModelRun::ResidualAdd(T residual, T branch) {
  if (!fam_.granite_multipliers) return BodyAdd(residual, branch);
  // GraniteDecoderLayer: `residual + hidden_states * self.residual_multiplier`, both the layer's
  // own ops.
  g_.SetBlockBody(true);
  T scaled = Scale(g_, branch);
  T sum = Add(g_, residual, scaled);
  g_.Drop(scaled);
  g_.SetBlockBody(false);
  return sum;
}

T ModelRun::TransformersDecoderBlock(int layer, T x) {
  const BlockParams& bp = blocks_[static_cast<size_t>(layer)];
  const double p = fam_.resid_dropout;
  auto dropped = [&](T t) {
    T d = Dropout(g_, t, p);
    g_.Drop(t);
    return d;
  };
  // The attention branch's dropout (none where the family drops out the MLP's output alone).
  auto attn_dropped = [&](T t) { return fam_.mlp_dropout_only ? t : dropped(t); };
  switch (fam_.layout) {
    case Family::Layout::kSequential: {
      // LlamaDecoderLayer.forward: x + attn(norm(x)), then + mlp(norm(.)); GPT-2, OPT and
      // Starcoder2 drop out each branch's output first.
      T h = NormAny(bp.norms[0], x);
      T attn = attn_dropped(TransformersAttention(layer, bp, h));
      g_.Drop(h);
      T x2 = ResidualAdd(x, attn);
      g_.Drop(attn);
      T h2 = NormAny(bp.norms[1], x2);
      T m = dropped(bp.expert.empty() ? TransformersMlp(bp, h2) : TransformersMoe(bp, h2));
      g_.Drop(h2);
      T out = ResidualAdd(x2, m);
      g_.Drop(m);
      g_.Drop(x2);
      return out;
    }
    case Family::Layout::kSandwich: {
      // Gemma2DecoderLayer / Gemma3DecoderLayer: norms before and after each branch.
      T h = NormAny(bp.norms[0], x);
      T attn = TransformersAttention(layer, bp, h);
      g_.Drop(h);
      T an = NormAny(bp.norms[1], attn);
      g_.Drop(attn);
      T x2 = BodyAdd(x, an);
      g_.Drop(an);
      T h2 = NormAny(bp.norms[2], x2);
      T m = TransformersMlp(bp, h2);
      g_.Drop(h2);
      T mn = NormAny(bp.norms[3], m);
      g_.Drop(m);
      T out = BodyAdd(x2, mn);
      g_.Drop(mn);
      g_.Drop(x2);
      return out;
    }
    case Family::Layout::kPostNorm: {
      // Olmo2DecoderLayer: x + post_attention_layernorm(attn(x)), then + post_feedforward
      // norm of mlp(.).
      T attn = TransformersAttention(layer, bp, x);
      T an = NormAny(bp.norms[0], attn);
      g_.Drop(attn);
      T x2 = BodyAdd(x, an);
      g_.Drop(an);
      T m = TransformersMlp(bp, x2);
      T mn = NormAny(bp.norms[1], m);
      g_.Drop(m);
      T out = BodyAdd(x2, mn);
      g_.Drop(mn);
      g_.Drop(x2);
      return out;
    }
    case Family::Layout::kParallel: {
      // PhiDecoderLayer, GPTJBlock: attention and MLP read the same norm of x;
      // attn + mlp + residual (StableLmDecoderLayer: residual + attn + mlp).
      T h = NormAny(bp.norms[0], x);
      T attn = attn_dropped(TransformersAttention(layer, bp, h));
      T m = dropped(TransformersMlp(bp, h));
      g_.Drop(h);
      T s1 = fam_.residual_first ? BodyAdd(x, attn) : BodyAdd(attn, m);
      g_.Drop(attn);
      if (!fam_.residual_first) g_.Drop(m);
      T out = BodyAdd(s1, fam_.residual_first ? m : x);
      g_.Drop(s1);
      if (fam_.residual_first) g_.Drop(m);
      return out;
    }
    case Family::Layout::kParallelTwoNorms: {
      // GPTNeoXLayer with use_parallel_residual: mlp(ln2(x)) + attn(ln1(x)) + x.
      T h = NormAny(bp.norms[0], x);
      T attn = dropped(TransformersAttention(layer, bp, h));
      g_.Drop(h);
      T h2 = NormAny(bp.norms[1], x);
      T m = dropped(TransformersMlp(bp, h2));
      g_.Drop(h2);
      T s1 = BodyAdd(m, attn);
      g_.Drop(attn);
      g_.Drop(m);
      T out = BodyAdd(s1, x);
      g_.Drop(s1);
      return out;
    }
  }
  return g_.Alias(x);
}

T ModelRun::CausalLmLoss(T hidden) {
  const Wide vocab = static_cast<Wide>(a_.vocab);
  const Wide h = static_cast<Wide>(a_.hidden);
  T logits = Linear(g_, hidden, head_, head_bias_, h, vocab);
  g_.SetPhase(StepPhase::kLoss);
  if (fam_.granite_multipliers || fam_.logit_scale) {
    // GraniteForCausalLM: `logits = logits / self.config.logits_scaling`; CohereForCausalLM:
    // `logits = logits * self.logit_scale`.
    T scaled = Scale(g_, logits);
    g_.Drop(logits);
    logits = scaled;
  }
  if (a_.final_softcap > 0) {
    // Gemma-2: logits / final_logit_softcapping, tanh, * final_logit_softcapping.
    T d1 = Scale(g_, logits);
    g_.Drop(logits);
    T th = Apply(g_, Unary::kTanh, d1);
    g_.Drop(d1);
    logits = Scale(g_, th);
    g_.Drop(th);
  }
  g_.SetPhase(StepPhase::kLoss);
  g_.SetWhere("loss");
  // ForCausalLMLoss: logits.float(), labels padded and shifted, cross_entropy.
  T up = Cast(g_, logits, DT::kF32);
  T labels = g_.New(batch_ * (seq_ + 1), DT::kI64, false);
  T loss = CrossEntropy(g_, up, tokens_, vocab);
  g_.Drop(up);
  g_.Drop(labels);
  // The training loop keeps `.loss` only: the output (logits, cache) goes.
  g_.Drop(logits);
  return loss;
}

// Note [Decoder classifiers in the step model]
// Transformers' decoder classifiers (GenericForSequenceClassification,
// GenericForTokenClassification and the families' own, which run the same ops): the score Linear
// over every token's final hidden state, in place of the LM head. A sequence classifier (a reward
// model) pools each sequence's last non-padding token's logits (int32 masks over the batch, an
// argmax, an index that keeps its indices) and ForSequenceClassificationLoss runs cross_entropy on
// them as they are; a token classifier drops out the hidden states first (classifier_dropout, else
// hidden_dropout, else 0.1) and ForTokenClassification casts the logits to fp32 first. A one-label
// sequence classifier (a reward model's score) is a regression: MSELoss, an fp32 op under
// autocast, on the squeezed pooled logits. Question answering is refused (CheckRunnable).
T ModelRun::DecoderClassifierLoss(T hidden) {
  const Wide labels = classifier_.out;
  const bool sequence = inv_.model_class == "sequence_classification";
  // A token classifier's sequence_output (its dropout's output) is a local of the model's
  // forward, which computes the loss.
  T x = sequence ? g_.Alias(hidden) : Dropout(g_, hidden, a_.classifier_dropout);
  T logits = LoraLinear(classifier_, x);
  g_.SetPhase(StepPhase::kLoss);
  g_.SetWhere("loss");
  T loss;
  std::vector<T> locals;
  if (sequence) {
    // non_pad_mask = (input_ids != pad_token_id).to(int32), token_indices = arange(seq) in int32,
    // last_non_pad_token = (token_indices * non_pad_mask).argmax(-1): locals of the forward (the
    // product a temporary).
    T ne_bool = g_.New(tokens_, DT::kBool, false);
    T ne = g_.New(tokens_, DT::kI32, false);
    g_.Drop(ne_bool);
    T positions = g_.New(seq_, DT::kI32, false);
    T product = g_.New(tokens_, DT::kI32, false);
    T last = g_.New(batch_, DT::kI64, false);
    g_.Drop(product);
    T rows = g_.New(batch_, DT::kI64, false);  // torch.arange(batch_size)
    T pooled = g_.New(batch_ * labels, g_.Dtype(logits), g_.RequiresGrad(logits));
    g_.Record(Graph::Spec("Index", {logits}, {pooled}, {rows, last}));
    g_.Drop(rows);
    locals = {ne, positions, last};
    if (labels > 1) {
      loss = CrossEntropyLoss(g_, pooled, batch_, labels);
    } else {
      T in = Fp32In(g_, pooled);
      loss = g_.New(1, DT::kF32, g_.RequiresGrad(in));
      g_.Record(Graph::Spec("MseLoss", {in}, {loss}, {in}));
      g_.Drop(in);
    }
    g_.Drop(pooled);
  } else {
    T up = Cast(g_, logits, DT::kF32);
    loss = CrossEntropy(g_, up, tokens_, labels);
    g_.Drop(up);
  }
  g_.Drop(logits);
  g_.Drop(x);
  for (T t : locals) g_.Drop(t);
  return loss;
}

Status ModelRun::CheckFamily() const {
  auto missing = [&](const std::string& what) {
    return Status::Unimplemented(inv_.name + ": the step model expects " + what + " in every " +
                                 "block of a " + inv_.model_type + " model");
  };
  for (const BlockParams& bp : blocks_) {
    const bool fused = bp.has(TensorRole::kAttentionQkv);
    if (fam_.mla) {
      // MLA: the query (full or through q_a_proj), the latent's down and up projections, and
      // their narrow norms (q_a_layernorm with q_a_proj, kv_a_layernorm).
      const size_t narrow = bp.has(TensorRole::kAttentionQDown) ? 2 : 1;
      if (!bp.has(TensorRole::kAttentionQ) || !bp.has(TensorRole::kAttentionKvDown) ||
          !bp.has(TensorRole::kAttentionKvUp) || bp.qk_norms.size() < narrow) {
        return missing("multi-head latent attention's projections and norms");
      }
    } else if (!fused && !(bp.has(TensorRole::kAttentionQ) && bp.has(TensorRole::kAttentionK) &&
                           bp.has(TensorRole::kAttentionV))) {
      return missing("query, key and value projections");
    }
    if (!bp.has(TensorRole::kAttentionOut)) return missing("an attention output projection");
    if (!bp.expert.empty()) {
      if (!bp.router.w.ok() || bp.expert.count(TensorRole::kExpertDown) == 0 ||
          (bp.expert.count(TensorRole::kExpertGateUp) == 0 &&
           bp.expert.count(TensorRole::kExpertUp) == 0)) {
        return missing("fused experts (gate_up_proj, down_proj) and a router");
      }
    } else if (!bp.experts.empty()) {
      return missing("experts fused as Transformers >= 5 builds them (not one Linear each)");
    } else if (!bp.has(TensorRole::kMlpDown)) {
      return missing("an MLP (dense or mixture of experts)");
    }
    if (bp.expert.empty() && !bp.has(TensorRole::kMlpGateUp) &&
        !(bp.has(TensorRole::kMlpUp) && (!fam_.gated || bp.has(TensorRole::kMlpGate)))) {
      return missing("the MLP's input projections");
    }
    size_t norms = 2;
    if (fam_.layout == Family::Layout::kSandwich) norms = 4;
    if (fam_.layout == Family::Layout::kParallel) norms = 1;
    if (bp.norms.size() < norms) return missing(std::to_string(norms) + " norms");
  }
  return Status::Ok();
}

Result<T> ModelRun::ForwardAndLoss() {
  switch (s_.framework) {
    case Framework::kTransformers: return TransformersForward();
    case Framework::kTorchtune: return TorchtuneForward();
    case Framework::kLitGpt: return LitGptForward();
    case Framework::kLlmFoundry: return FoundryForward();
    case Framework::kTorchtitan: return TorchtitanForward();
    default: break;
  }
  return Status::Unimplemented("the step model does not run " +
                               std::string(FrameworkName(s_.framework)) + " yet");
}

Result<T> ModelRun::TransformersForward() {
  if (enc_.on) return EncoderForward();
  if (t5_.on) return T5Forward();
  if (!a_.causal || a_.encoder_decoder || (a_.kv_lora_rank > 0 && !fam_.mla) ||
      (a_.alibi && !fam_.bloom_attention && !fam_.falcon_alibi)) {
    return Status::Unimplemented(
        "the step model runs Transformers' dense decoder LMs, encoder masked LMs and "
        "classifiers (BERT, RoBERTa, XLM-RoBERTa, DistilBERT) and T5ForConditionalGeneration "
        "so far");
  }
  MEMPLAN_RETURN_IF_ERROR(CheckFamily());
  if (fam_.gpt_oss) MEMPLAN_RETURN_IF_ERROR(CheckGptOss());
  const bool ckpt = s_.checkpointing == Checkpointing::kFull;
  use_cache_ = a_.use_cache && !ckpt;
  // No padding, so create_causal_mask lets SDPA run causal with no mask, checkpointed or not
  // (memplan.trace's _unpacked_position_ids: traced on fake tensors, Transformers took every
  // cacheless step for packed sequences and made one).
  explicit_mask_ = false;
  const Wide h = static_cast<Wide>(a_.hidden);
  g_.SetWhere("embedding");
  T x = Embedding(g_, embedding_, tokens_, h, pdt_);
  // Note [The frozen embedding's leaf]
  // With checkpointing, enable_input_require_grads hooks the input embedding module: its output
  // requires grad. When the embedding is frozen (LoRA) that output has no grad_fn: it is a leaf,
  // and the AccumulateGrad node of whatever consumes it holds it until backward reaches that
  // node, at its very end. Where the model works on the embeddings outside the embedding module
  // (GPT-2's and OPT's positions, Bloom's layer norm, Granite's multiplier, Starcoder2's dropout)
  // the module's output thus outlives its last use by the whole step: the traces of those
  // models' LoRA steps have it alive through forward and backward (32 MiB in fp32 for Granite
  // 8B's batch of 2 x 1024). Gemma scales inside its embedding module, so its output is the
  // scaled one; where the output goes straight into the first layer, the layer's checkpoint
  // keeps it anyway.
  if (!fam_.embedding_scale) HoldEmbeddingLeaf(x);
  if (fam_.embedding_scale) {
    // GemmaTextScaledWordEmbedding: the lookup times embed_scale (a 0-dim tensor of the
    // weight's dtype), inside the module.
    T normalizer = g_.New(1, g_.Dtype(x), false);
    T xs = Mul(g_, x, normalizer);
    g_.Drop(normalizer);
    g_.Drop(x);
    x = xs;
    HoldEmbeddingLeaf(x);
  }
  if (fam_.granite_multipliers) {
    // GraniteModel: inputs_embeds * self.embedding_multiplier.
    T xs = Scale(g_, x);
    g_.Drop(x);
    x = xs;
  }
  // The model's forward keeps inputs_embeds (and GPT-2's and OPT's position embeddings) as
  // locals until it returns, after the final norm: where nothing saves them (a 16-bit model's
  // RMSNorm saves its fp32 copy), they still hold memory through every layer.
  T inputs_embeds = g_.Alias(x);
  T position_embeds;
  if (fam_.learned_positions && position_embedding_.ok()) {
    // GPT-2 / OPT: inputs_embeds + position embeddings.
    position_embeds = Embedding(g_, position_embedding_, tokens_, h, pdt_);
    T xs = Add(g_, x, position_embeds);
    g_.Drop(x);
    x = xs;
  }
  if (fam_.embedding_norm && final_norms_.size() >= 2) {
    // BloomModel: word_embeddings_layernorm(inputs_embeds).
    T xn = NormAny(final_norms_[0], x);
    g_.Drop(x);
    x = xn;
  }
  if (fam_.embedding_dropout > 0) {
    T xd = Dropout(g_, x, fam_.embedding_dropout);
    g_.Drop(x);
    x = xd;
  }
  if (ckpt) {
    // activation_checkpointing_enable -> enable_input_require_grads: the embedding output
    // requires grad (matters when the embedding is frozen, as with LoRA).
    g_.SetRequiresGrad(x, true);
  }
  if (!fam_.gpt_oss && !(fam_.mla && !fam_.mla_v3) && inv_.model_type != "opt" &&
      inv_.model_type != "gptj") {
    // The model's forward: position_ids = arange(seq) + past_seen_tokens, a local passed to
    // every layer (a checkpointed layer keeps it until its backward). gpt-oss makes them in
    // GptOssTables, DeepSeek-V2 beside its complex table; OPT's come from the attention mask and
    // GPT-J's points are over by more already (not modelled, left as they were).
    T arange = g_.New(seq_, DT::kI64, false);
    positions_ = g_.New(seq_, DT::kI64, false);
    g_.Drop(arange);
  }
  if (fam_.gpt_oss) {
    GptOssTables(g_.Dtype(x));
  } else if (fam_.mla) {
    MlaRotaryTable(g_.Dtype(x));
  } else if (fam_.rotary || fam_.falcon_alibi) {
    // The rotary embedding's forward: cos and sin (seq x rotary dims) in fp32, cast to x's dtype
    // (OLMo's stay fp32: its rotation casts its result back instead). FalconModel makes them
    // with ALiBi too, and passes them to every layer unused.
    const Wide d = fam_.rotary_dims > 0 ? fam_.rotary_dims : static_cast<Wide>(a_.head_dim);
    T c32 = g_.New(seq_ * d, DT::kF32, false);
    T s32 = g_.New(seq_ * d, DT::kF32, false);
    const DT table = fam_.rotary_fp32_tables ? DT::kF32 : g_.Dtype(x);
    cos_ = Cast(g_, c32, table);
    sin_ = Cast(g_, s32, table);
    g_.Drop(c32);
    g_.Drop(s32);
  }
  if (fam_.gpt_oss) {
    // GptOssTables made the masks.
  } else if (fam_.falcon_alibi) {
    // FalconModel.forward: build_alibi_tensor (slopes x positions, batch x heads x seq, in the
    // embeddings' dtype), a local passed to every layer; then ALiBi / sqrt(head_dim), masked, as
    // one float mask (batch x heads x seq x seq) in the embeddings' dtype for every layer.
    alibi_ = g_.New(batch_ * static_cast<Wide>(a_.heads) * seq_, g_.Dtype(x), false);
    explicit_mask_ = true;
    mask_ = g_.New(batch_ * static_cast<Wide>(a_.heads) * seq_ * seq_, g_.Dtype(x), false);
  } else if (!sdpa_ || explicit_mask_ || fam_.bloom_attention || AnySlidingMasked()) {
    // The causal mask: boolean for SDPA, additive in the hidden states' dtype for eager.
    const bool boolean = sdpa_ && !fam_.bloom_attention;
    mask_ = g_.New(batch_ * seq_ * seq_, boolean ? DT::kBool : g_.Dtype(x), false);
  }
  x = RunLayers(x);
  g_.SetWhere("final norm");
  T hn = final_norms_.empty() ? g_.Alias(x) : NormAny(final_norms_.back(), x);
  g_.Drop(x);
  g_.Drop(inputs_embeds);
  g_.Drop(position_embeds);
  g_.Drop(cos_);
  g_.Drop(sin_);
  g_.Drop(mask_);
  g_.Drop(alibi_);
  g_.Drop(sliding_mask_);
  g_.Drop(positions_);
  g_.SetWhere("lm_head");
  T loss = classifier_.ok() ? DecoderClassifierLoss(hn) : CausalLmLoss(hn);
  g_.Drop(hn);
  g_.ClearAutocastCache();
  for (T c : cache_) g_.Drop(c);
  cache_.clear();
  return loss;
}

}  // namespace memplan::estimator::step
