// The torchtune, LitGPT and llm-foundry blocks of the step model (Note [The step model] in
// step_model.h): each reads like the framework's forward, naming its file and function; the
// Transformers blocks are in step_blocks.cc, the parameters' layout in step_prepare.cc.
#include <algorithm>
#include <cstdint>

#include "estimator/step_blocks.h"
#include "estimator/step_ops.h"

namespace memplan::estimator::step {

// --- torchtune ------------------------------------------------------------------------------

T ModelRun::TorchtuneRmsNorm(const Norm& n, T x) {
  // torchtune/modules/rms_norm.py: F.rms_norm(x.float(), weight=self.scale).to(x.dtype); the
  // fused kernel keeps its (fp32) input and an fp32 rstd per row.
  const DT in = g_.Dtype(x);
  T xf = Cast(g_, x, DT::kF32);
  T y = FusedRmsNorm(g_, xf, n.w, n.width);
  g_.Drop(xf);
  T out = Cast(g_, y, in);
  g_.Drop(y);
  return out;
}

T ModelRun::TorchtuneRope(T x) {
  // RotaryPositionalEmbeddings.forward (torchtune/modules/position_embeddings.py): x.float()
  // reshaped in pairs, multiplied with the cache (a buffer), stacked, flattened, type_as(x).
  // Only the cache is saved.
  T xf = Cast(g_, x, DT::kF32);
  T st = g_.New(g_.Numel(x), DT::kF32, g_.RequiresGrad(xf));
  g_.Record(Graph::Spec("Rope", {xf}, {st}));
  g_.Drop(xf);
  T out = Cast(g_, st, g_.Dtype(x));
  g_.Drop(st);
  return out;
}

T ModelRun::TorchtuneLinear(const Lin& l, T x) {
  T out;
  if (quantized_base_ && !g_.RequiresGrad(l.w)) {
    // LoRALinear with quantize_base / FrozenNF4Linear: torchao's LinearNF4 keeps the NF4
    // weight only; the weight is dequantized to the input's dtype for the matmul (and again in
    // backward) by NF4Tensor.get_original_weight (torchao/dtypes/nf4tensor.py), whose locals
    // all live until it returns: the high and low nibbles as int64 (n/2 each), their NF4 values
    // and their scaled values (n/2 each in the weight's dtype), the scalers (one per 64-block),
    // and the stacked weight (n). Its smaller transients (the uint8 shifts, each flattened
    // repeat of the scalers) come and go below that peak.
    const Wide n = l.in * l.out, half = n / 2;
    const DT wdt = g_.Dtype(x);
    const std::vector<std::pair<Wide, DT>> locals = {
        {half, DT::kI64}, {half, DT::kI64}, {half, wdt}, {half, wdt},
        {n / 64, wdt},    {half, wdt},      {half, wdt}};
    std::vector<T> held;
    for (const auto& [numel, dt] : locals) held.push_back(g_.New(numel, dt, false));
    T wd = g_.New(n, wdt, false);
    for (T t : held) g_.Drop(t);
    out = g_.New(g_.Numel(x) / std::max<Wide>(l.in, 1) * l.out, g_.Dtype(x), g_.RequiresGrad(x));
    Graph::NodeSpec spec = Graph::Spec("LinearNF4", {x}, {out});
    spec.scratch = locals;
    spec.scratch.emplace_back(n, wdt);
    spec.extra = {{n, wdt}};
    g_.Record(std::move(spec));
    g_.Drop(wd);
  } else {
    out = Linear(g_, x, l.w, l.b, l.in, l.out);
  }
  if (!l.lora_a.ok()) return out;
  // LoRALinear.forward: out + (alpha / rank) * lora_b(lora_a(dropout(x))), dropout 0.
  const Wide r = static_cast<Wide>(s_.lora_rank);
  T ya = Linear(g_, x, l.lora_a, T{}, l.in, r);
  T yb = Linear(g_, ya, l.lora_b, T{}, r, l.out);
  g_.Drop(ya);
  T ys = Scale(g_, yb);
  g_.Drop(yb);
  T sum = Add(g_, out, ys);
  g_.Drop(out);
  g_.Drop(ys);
  return sum;
}

// --- Shared by the torchtune and LitGPT blocks, which call SDPA at query width ----------------

void ModelRun::ExpandKvToQueryHeads(Wide heads, Wide kv, T* k, T* v) {
  // Grouped-query attention repeated in Python before SDPA (torchtune's expand + flatten, LitGPT's
  // repeat_interleave): k and v copied at query width.
  if (kv == heads) return;
  for (T* t : {k, v}) {
    T wide = Copy(g_, *t, g_.Numel(*t) * (heads / kv));
    g_.Drop(*t);
    *t = wide;
  }
}

AttentionShape ModelRun::SelfAttentionShape(Wide heads, Wide kv, Wide d) const {
  AttentionShape as;
  as.batch = batch_;
  as.heads = heads;
  as.kv_heads = kv;
  as.seq = as.kv_seq = seq_;
  as.head_dim = as.v_head_dim = d;
  return as;
}

SdpaBackend ModelRun::CausalSdpaBackend(DT compute) const {
  // What SDPA's dispatcher picks for a causal call without a mask: fp32 runs the
  // memory-efficient kernel; half precision cuDNN on Hopper, flash from Ampere.
  const int sm = s_.GpuSm();
  return !Half(compute)         ? SdpaBackend::kEfficient
         : sm >= 90 && sm < 110 ? SdpaBackend::kCudnn
         : sm >= 80             ? SdpaBackend::kFlash
                                : SdpaBackend::kEfficient;
}

T ModelRun::TorchtuneBlock(int layer, T x) {
  // TransformerSelfAttentionLayer.forward: h = attn(sa_norm(x)) + x; h + mlp(mlp_norm(h)).
  const BlockParams& bp = blocks_[static_cast<size_t>(layer)];
  const Wide heads = static_cast<Wide>(a_.heads), kv = static_cast<Wide>(a_.kv_heads);
  const Wide d = static_cast<Wide>(a_.head_dim);
  T h = TorchtuneRmsNorm(bp.norms[0], x);
  // MultiHeadAttention.forward (torchtune/modules/attention.py).
  T q0 = TorchtuneLinear(bp.at(TensorRole::kAttentionQ), h);
  T q = TorchtuneRope(q0);
  g_.Drop(q0);
  T k0 = TorchtuneLinear(bp.at(TensorRole::kAttentionK), h);
  T v = TorchtuneLinear(bp.at(TensorRole::kAttentionV), h);
  g_.Drop(h);
  T k = TorchtuneRope(k0);
  g_.Drop(k0);
  // k.unsqueeze(2).expand(...).flatten(1, 2): copies at query width.
  ExpandKvToQueryHeads(heads, kv, &k, &v);
  const AttentionShape as = SelfAttentionShape(heads, heads, d);
  T att = Sdpa(g_, CausalSdpaBackend(g_.Dtype(q)), q, k, v, as, T{});
  g_.Drop(q);
  g_.Drop(k);
  g_.Drop(v);
  T o = TorchtuneLinear(bp.at(TensorRole::kAttentionOut), att);
  g_.Drop(att);
  // h = self.sa_scale(attn_out) + x: the local attn_out (sa_scale is an Identity) holds the
  // attention's output until the layer returns, through the whole MLP.
  T x2 = Add(g_, o, x);
  // FeedForward.forward: w2(silu(w1(x)) * w3(x)).
  T h2 = TorchtuneRmsNorm(bp.norms[1], x2);
  T g1 = TorchtuneLinear(bp.at(TensorRole::kMlpGate), h2);
  T a = Apply(g_, Unary::kSilu, g1);
  g_.Drop(g1);
  T u = TorchtuneLinear(bp.at(TensorRole::kMlpUp), h2);
  g_.Drop(h2);
  T m = Mul(g_, a, u);
  g_.Drop(a);
  g_.Drop(u);
  T down = TorchtuneLinear(bp.at(TensorRole::kMlpDown), m);
  g_.Drop(m);
  T out = Add(g_, x2, down);
  g_.Drop(down);
  g_.Drop(x2);
  g_.Drop(o);
  return out;
}

Result<T> ModelRun::TorchtuneForward() {
  if (!a_.causal || a_.encoder_decoder || a_.experts > 0 || !a_.gated_mlp || a_.rotary_dims == 0) {
    return Status::Unimplemented(inv_.name +
                                 ": the step model runs torchtune's dense decoders (Llama, Qwen2, "
                                 "Mistral-shaped) only");
  }
  MEMPLAN_RETURN_IF_ERROR(CheckFamily());
  const Wide h = static_cast<Wide>(a_.hidden);
  const Wide vocab = static_cast<Wide>(a_.vocab);
  g_.SetWhere("embedding");
  T x = Embedding(g_, embedding_, tokens_, h, pdt_);
  x = RunLayers(x);
  g_.SetWhere("final norm");
  // forward's `h` (the last layer's output) stays alive while unembed normalizes it and runs
  // the output projection: unembed rebinds its own `h`, and forward's goes when it returns.
  T hn = TorchtuneRmsNorm(final_norms_.back(), x);
  g_.SetWhere("output");
  const Lin head{head_, head_bias_, h, vocab, T{}, T{}};
  // The recipe's _loss_step: labels shifted (hstack with the ignore cache), the loss, del
  // logits.
  T labels = g_.New(tokens_, DT::kI64, false);
  T loss;
  if (s_.loss == Loss::kChunked) {
    // TransformerDecoder.chunked_output: the output projection per chunk of the sequence;
    // CEWithChunkedOutputLoss: each chunk's logits.float() into cross_entropy (sum).
    const Wide chunks = static_cast<Wide>(s_.loss_chunks > 0 ? s_.loss_chunks : 8);
    // h.chunk(n, dim=1) is one SplitBackward for every chunk. A chunk of more than one sequence
    // is not contiguous, and F.linear's matmul folds it to rows with a copy, which mm saves: the
    // trace's clone per chunk, freed by that chunk's backward; one sequence's chunk is a view.
    std::vector<T> logits;
    for (T part : Split(g_, hn, chunks)) {
      T rows = batch_ > 1 ? Copy(g_, part) : part;
      logits.push_back(Linear(g_, rows, head.w, head.b, h, vocab));
      if (rows.id != part.id) g_.Drop(rows);
      g_.Drop(part);
    }
    g_.SetPhase(StepPhase::kLoss);  // the model's forward returns
    g_.Drop(hn);
    g_.Drop(x);
    for (T lc : logits) {
      T up = Cast(g_, lc, DT::kF32);
      T l = CrossEntropy(g_, up, tokens_ / chunks, vocab);
      g_.Drop(up);
      loss = AddLoss(loss, l);
    }
    for (T lc : logits) g_.Drop(lc);
  } else {
    // TransformerDecoder.unembed: self.output(h).float().
    T lg = Linear(g_, hn, head.w, head.b, h, vocab);
    g_.SetPhase(StepPhase::kLoss);
    T up = Cast(g_, lg, DT::kF32);
    g_.Drop(lg);
    g_.Drop(hn);
    g_.Drop(x);
    loss = CrossEntropy(g_, up, tokens_, vocab);
    g_.Drop(up);
  }
  g_.Drop(labels);
  return loss;
}

// --- LitGPT ---------------------------------------------------------------------------------

T ModelRun::LitGptRmsNorm(const Norm& n, T x) {
  // litgpt/model.py RMSNorm.forward:
  //   x = x.float(); norm_x = torch.mean(x * x, dim=-1, keepdim=True)
  //   x_normed = x * torch.rsqrt(norm_x + eps); return (x_normed * weight.float()).to(dtype)
  // norm_x and x_normed are locals until it returns.
  const DT in = g_.Dtype(x);
  T var;
  T xn = RmsNormalizedF32(n, x, Square::kSelfMul, &var);
  T wf = Cast(g_, n.w, DT::kF32);
  T y = Mul(g_, xn, wf);
  g_.Drop(wf);
  T out = Cast(g_, y, in);
  g_.Drop(y);
  g_.Drop(xn);
  g_.Drop(var);
  return out;
}

T ModelRun::LitGptLinear(const Lin& l, T x, bool qkv) {
  T out = Linear(g_, x, l.w, l.b, l.in, l.out);
  if (!l.lora_a.ok()) return out;
  // LoRALinear / LoRAQKVLinear.forward (litgpt/lora.py): lora_dropout(x), lora_A, lora_B (a
  // grouped conv1d for the fused query/key/value), zero_pad's index_copy_ into a zeroed
  // full-width tensor when only some of q/k/v are adapted, * scaling, + pretrained.
  const Wide r = static_cast<Wide>(s_.lora_rank);
  const int parts = qkv ? (lora_q_ ? 1 : 0) + (lora_k_ ? 1 : 0) + (lora_v_ ? 1 : 0) : 1;
  const Wide q = static_cast<Wide>(a_.heads * a_.head_dim);
  const Wide kvw = static_cast<Wide>(a_.kv_heads * a_.head_dim);
  const Wide enabled_out =
      qkv ? (lora_q_ ? q : 0) + (lora_k_ ? kvw : 0) + (lora_v_ ? kvw : 0) : l.out;
  T xd = Dropout(g_, x, s_.LoraDropout());
  T ya = Linear(g_, xd, l.lora_a, T{}, l.in, r * static_cast<Wide>(parts));
  g_.Drop(xd);
  T yb = Linear(g_, ya, l.lora_b, T{}, r * static_cast<Wide>(parts), enabled_out);
  g_.Drop(ya);
  if (qkv && enabled_out != l.out) {
    // zero_pad: x.new_zeros(..., out_features).index_copy_(-1, self.lora_ind, x), where
    // lora_ind returns a clone of the _lora_ind buffer; index_copy_'s backward keeps the index
    // and the source (derivatives.yaml: index_copy saves both).
    T index = g_.New(enabled_out, DT::kI64, false);
    T padded = g_.New(g_.Numel(yb) / std::max<Wide>(enabled_out, 1) * l.out, g_.Dtype(yb), true);
    g_.Record(Graph::Spec("IndexCopy", {yb}, {padded}, {yb, index}));
    g_.Drop(index);
    g_.Drop(yb);
    yb = padded;
  }
  T ys = Scale(g_, yb);
  g_.Drop(yb);
  T sum = Add(g_, out, ys);
  g_.Drop(out);
  g_.Drop(ys);
  return sum;
}

T ModelRun::LitGptBlock(int layer, T x) {
  // litgpt/model.py Block.forward and CausalSelfAttention.forward.
  const BlockParams& bp = blocks_[static_cast<size_t>(layer)];
  const Wide heads = static_cast<Wide>(a_.heads), kv = static_cast<Wide>(a_.kv_heads);
  const Wide d = static_cast<Wide>(a_.head_dim);
  auto norm = [&](const Norm& n, T t) {
    return a_.norm_upcasts ? LitGptRmsNorm(n, t) : LayerNorm(g_, t, n.w, n.b, n.width);
  };
  T xn = norm(bp.norms[0], x);
  T qkv = LitGptLinear(litgpt_qkv_[static_cast<size_t>(layer)], xn, true);
  T q = Slice(g_, qkv, tokens_ * heads * d);
  T k = Slice(g_, qkv, tokens_ * kv * d);
  T v = Slice(g_, qkv, tokens_ * kv * d);
  g_.Drop(qkv);
  // apply_rope over q[..., :rope_n_elem] (roped.to(dtype=x.dtype)), then
  // torch.cat((q_roped, q[..., rope_n_elem:])): a copy even when the whole head is roped.
  auto rope = [&](T t) {
    T r = ApplyRotary(t);
    T rc = Cast(g_, r, g_.Dtype(t));
    g_.Drop(r);
    T full = Copy(g_, rc);
    g_.Drop(rc);
    return full;
  };
  T qr = rope(q);
  g_.Drop(q);
  T kr = rope(k);
  g_.Drop(k);
  // k.repeat_interleave(q_per_kv, dim=1), v too.
  ExpandKvToQueryHeads(heads, kv, &kr, &v);
  const AttentionShape as = SelfAttentionShape(heads, heads, d);
  const SdpaBackend backend = CausalSdpaBackend(autocast_ ? adt_ : g_.Dtype(qr));
  T qc = AutocastIn(g_, qr), kc = AutocastIn(g_, kr), vc = AutocastIn(g_, v);
  g_.Drop(qr);
  g_.Drop(kr);
  g_.Drop(v);
  T y = Sdpa(g_, backend, qc, kc, vc, as, T{});
  g_.Drop(qc);
  g_.Drop(kc);
  g_.Drop(vc);
  // y.transpose(1, 2).reshape(B, T, -1): the query, a torch.cat, is heads-major.
  y = SeqMajor(y, backend, /*heads_major_query=*/true);
  T att = LitGptLinear(bp.at(TensorRole::kAttentionOut), y, false);
  g_.Drop(y);
  auto mlp = [&](T hin) {
    if (bp.has(TensorRole::kMlpGate)) {
      // LLaMAMLP: proj(silu(fc_1(x)) * fc_2(x)).
      T f1 = LitGptLinear(bp.at(TensorRole::kMlpGate), hin, false);
      T f2 = LitGptLinear(bp.at(TensorRole::kMlpUp), hin, false);
      T a = Apply(g_, Unary::kSilu, f1);
      g_.Drop(f1);
      T m = Mul(g_, a, f2);
      g_.Drop(a);
      g_.Drop(f2);
      T o = LitGptLinear(bp.at(TensorRole::kMlpDown), m, false);
      g_.Drop(m);
      return o;
    }
    // GptNeoxMLP: proj(gelu(fc(x))).
    T f = LitGptLinear(bp.at(TensorRole::kMlpUp), hin, false);
    T a = Apply(g_, Unary::kGelu, f);
    g_.Drop(f);
    T o = LitGptLinear(bp.at(TensorRole::kMlpDown), a, false);
    g_.Drop(a);
    return o;
  };
  T out;
  if (fam_.layout == Family::Layout::kParallelTwoNorms) {
    // parallel_residual: mlp(norm_2(x)) + attention_output + x.
    g_.Drop(xn);
    T h2 = norm(bp.norms[1], x);
    T m = mlp(h2);
    g_.Drop(h2);
    T s1 = Add(g_, m, att);
    g_.Drop(m);
    g_.Drop(att);
    out = Add(g_, s1, x);
    g_.Drop(s1);
  } else {
    g_.Drop(xn);
    T x2 = Add(g_, att, x);
    g_.Drop(att);
    T h2 = norm(bp.norms[1], x2);
    T m = mlp(h2);
    g_.Drop(h2);
    out = Add(g_, m, x2);
    g_.Drop(m);
    g_.Drop(x2);
  }
  return out;
}

Result<T> ModelRun::LitGptForward() {
  if (!a_.causal || a_.encoder_decoder || a_.experts > 0 || a_.rotary_dims == 0) {
    return Status::Unimplemented(inv_.name +
                                 ": the step model runs LitGPT's dense rotary GPTs (Llama, "
                                 "Mistral, Pythia-shaped) only");
  }
  MEMPLAN_RETURN_IF_ERROR(CheckFamily());
  const Wide h = static_cast<Wide>(a_.hidden);
  const Wide vocab = static_cast<Wide>(a_.vocab);
  g_.SetWhere("embedding");
  T x = Embedding(g_, embedding_, tokens_, h, pdt_);
  // cos and sin: slices of the model's fp32 buffers (no memory of their own).
  const Wide rd = static_cast<Wide>(a_.rotary_dims);
  cos_ = g_.External(seq_ * rd, DT::kF32);
  sin_ = g_.External(seq_ * rd, DT::kF32);
  x = RunLayers(x);
  g_.SetWhere("final norm");
  const Norm& ln_f = final_norms_.back();
  T hn = a_.norm_upcasts ? LitGptRmsNorm(ln_f, x) : LayerNorm(g_, x, ln_f.w, ln_f.b, ln_f.width);
  g_.Drop(x);
  g_.SetWhere("lm_head");
  T loss;
  std::vector<T> fp32;
  if (s_.loss == Loss::kChunked) {
    // GPT.forward(lm_head_chunk_size=128): the head per 128 positions; Fabric's precision plugin
    // converts each output to fp32 (convert_output); chunked_cross_entropy per chunk (the last
    // one sliced by one position, a copy).
    // loss_chunks counts chunks (TrainingSetup); LitGPT's own is 128 positions a chunk.
    const Wide chunk = s_.loss_chunks > 0
                           ? std::max<Wide>(1, (seq_ + static_cast<Wide>(s_.loss_chunks) - 1) /
                                                   static_cast<Wide>(s_.loss_chunks))
                           : 128;
    const Wide chunks = (seq_ + chunk - 1) / chunk;
    std::vector<T> bf;
    for (Wide c = 0; c < chunks; ++c) {
      const Wide rows = batch_ * std::min(chunk, seq_ - c * chunk);
      T part = Slice(g_, hn, rows * h);
      bf.push_back(Linear(g_, part, head_, head_bias_, h, vocab));
      g_.Drop(part);
    }
    g_.Drop(hn);
    g_.SetPhase(StepPhase::kLoss);
    for (T b : bf) {
      fp32.push_back(Cast(g_, b, DT::kF32));
      g_.Drop(b);
    }
    // The last chunk loses its last position (logits[-1][..., :-1, :]); reshape(-1, V) copies
    // that slice unless the batch is one row, where the slice is contiguous and stays a view.
    for (size_t c = 0; c < fp32.size(); ++c) {
      T in = c + 1 == fp32.size() && batch_ > 1 ? Copy(g_, fp32[c]) : g_.Alias(fp32[c]);
      T l = CrossEntropy(g_, in, g_.Numel(in) / vocab, vocab);
      g_.Drop(in);
      loss = AddLoss(loss, l);
    }
  } else {
    T lg = Linear(g_, hn, head_, head_bias_, h, vocab);
    g_.Drop(hn);
    g_.SetPhase(StepPhase::kLoss);
    fp32.push_back(Cast(g_, lg, DT::kF32));
    g_.Drop(lg);
    // logits[..., :-1, :].reshape(-1, V): a copy (a view when the batch is one row), then
    // cross_entropy.
    T in = batch_ > 1 ? Copy(g_, fp32[0], batch_ * (seq_ - 1) * vocab)
                      : View(g_, fp32[0], (seq_ - 1) * vocab);
    loss = CrossEntropy(g_, in, batch_ * (seq_ - 1), vocab);
    g_.Drop(in);
  }
  for (T f : fp32) g_.Drop(f);
  g_.ClearAutocastCache();
  return loss;
}

// --- llm-foundry ------------------------------------------------------------------------------

T ModelRun::FoundryNorm(const Norm& n, T x) {
  // LPLayerNorm.forward (llmfoundry/models/layers/norm.py), MPT's low_precision_layernorm: under
  // autocast _cast_if_autocast_enabled casts the input, weight and bias to the autocast dtype by
  // hand (plain .to: new copies each call, no weight cache) and F.layer_norm runs with autocast
  // off, so the output, the saved input and the saved weight copy are 16-bit. Without autocast
  // it is F.layer_norm.
  if (!autocast_) return LayerNorm(g_, x, n.w, n.b, n.width);
  T xc = Cast(g_, x, adt_);
  T wc = Cast(g_, n.w, adt_);
  T bc = n.b.ok() ? Cast(g_, n.b, adt_) : T{};
  g_.SetAutocast(false, adt_);
  T y = LayerNorm(g_, xc, wc, bc, n.width);
  g_.SetAutocast(true, adt_);
  g_.Drop(xc);
  g_.Drop(wc);
  if (bc.ok()) g_.Drop(bc);
  return y;
}

T ModelRun::FoundryAttention(const BlockParams& bp, T a) {
  // GroupedQueryAttention.forward (llmfoundry/models/layers/attention.py): qkv = Wqkv(x) split
  // into query, key and value (views), then scaled_multihead_dot_product_attention, out_proj.
  const Wide heads = static_cast<Wide>(a_.heads), kv = static_cast<Wide>(a_.kv_heads);
  const Wide d = static_cast<Wide>(a_.head_dim);
  T qkv = Linear(g_, a, bp.at(TensorRole::kAttentionQkv).w, bp.at(TensorRole::kAttentionQkv).b,
                 bp.at(TensorRole::kAttentionQkv).in, bp.at(TensorRole::kAttentionQkv).out);
  T q = Slice(g_, qkv, tokens_ * heads * d);
  T k = Slice(g_, qkv, tokens_ * kv * d);
  T v = Slice(g_, qkv, tokens_ * kv * d);
  g_.Drop(qkv);
  // scaled_multihead_dot_product_attention: q, k, v rearranged (views: b h s d, b h d s,
  // b h s d); grouped keys and values repeated by repeat_kv_for_gqa (expand + reshape of the
  // transposed view: a copy at query width), then q.matmul(k): matmul reshapes the permuted
  // operands into contiguous bmm inputs (copies; multi-query keys and values are expanded to
  // every head there), which bmm saves.
  if (kv > 1 && kv < heads) {
    for (T* t : {&k, &v}) {
      T wide = Copy(g_, *t, g_.Numel(*t) * (heads / kv));
      g_.Drop(*t);
      *t = wide;
    }
  }
  T qc = Copy(g_, q);
  g_.Drop(q);
  T kc = Copy(g_, k, tokens_ * heads * d);
  g_.Drop(k);
  T scores = AutocastBmm(g_, "Bmm(qk)", qc, kc, batch_ * heads * seq_ * seq_);
  // attn_weight * softmax_scale, + attn_bias (the fp32 ALiBi bias: the scores become fp32).
  T w = Scale(g_, scores);
  g_.Drop(scores);
  if (attn_bias_.ok()) {
    T biased = Add(g_, w, attn_bias_);
    g_.Drop(w);
    w = biased;
  }
  // The causal mask, built per call under no grad: new_ones(s, s) in fp32, tril, to(bool), ~;
  // masked_fill keeps the boolean mask.
  T ones = g_.New(seq_ * seq_, DT::kF32, false);
  T tril = g_.New(seq_ * seq_, DT::kF32, false);
  g_.Drop(ones);
  T bools = g_.New(seq_ * seq_, DT::kBool, false);
  g_.Drop(tril);
  T mask = g_.New(seq_ * seq_, DT::kBool, false);
  g_.Drop(bools);
  T masked = g_.New(g_.Numel(w), g_.Dtype(w), g_.RequiresGrad(w));
  g_.Record(Graph::Spec("MaskedFill", {w}, {masked}, {mask}));
  g_.Drop(mask);
  g_.Drop(w);
  // torch.softmax(attn_weight, dim=-1): an fp32 op under autocast; dropout (attn_pdrop);
  // attn_weight.to(v.dtype).matmul(v): v's permuted view copied for bmm, as the keys were.
  T probs = Softmax(g_, masked, autocast_ ? DT::kF32 : g_.Dtype(masked));
  g_.Drop(masked);
  T dropped = Dropout(g_, probs, a_.attention_dropout);
  g_.Drop(probs);
  T pc = Cast(g_, dropped, g_.Dtype(v));
  g_.Drop(dropped);
  T vc = Copy(g_, v, tokens_ * heads * d);
  g_.Drop(v);
  T o = AutocastBmm(g_, "Bmm(pv)", pc, vc, tokens_ * heads * d);
  // rearrange(out, 'b h s d -> b s (h d)'): a copy; then out_proj.
  T merged = Copy(g_, o);
  g_.Drop(o);
  const Lin& out_proj = bp.at(TensorRole::kAttentionOut);
  T out = Linear(g_, merged, out_proj.w, out_proj.b, out_proj.in, out_proj.out);
  g_.Drop(merged);
  return out;
}

T ModelRun::FoundryBlock(int layer, T x) {
  // MPTBlock.forward (llmfoundry/models/layers/blocks.py):
  //   a = norm_1(x); b = attn(a); x = x + resid_attn_dropout(b); m = norm_2(x)
  //   n = ffn(m); x = x + resid_ffn_dropout(n)
  const BlockParams& bp = blocks_[static_cast<size_t>(layer)];
  T a = FoundryNorm(bp.norms.front(), x);
  T b = FoundryAttention(bp, a);
  g_.Drop(a);
  T bd = Dropout(g_, b, a_.hidden_dropout);
  g_.Drop(b);
  T x2 = Add(g_, x, bd);
  g_.Drop(bd);
  T m = FoundryNorm(bp.norms.back(), x2);
  // MPTMLP.forward: down_proj(act(up_proj(x))); MPTGLU.forward: down_proj(act(gate_proj(x)) *
  // up_proj(x)). The act is ffn_act_fn, GELU (approximate 'none') by default.
  const Lin& up = bp.at(TensorRole::kMlpUp);
  const Lin& down = bp.at(TensorRole::kMlpDown);
  T hidden;
  if (bp.has(TensorRole::kMlpGate)) {
    const Lin& gate = bp.at(TensorRole::kMlpGate);
    T gl = Linear(g_, m, gate.w, gate.b, gate.in, gate.out);
    T act = Activation(gl);
    g_.Drop(gl);
    T ul = Linear(g_, m, up.w, up.b, up.in, up.out);
    hidden = Mul(g_, act, ul);
    g_.Drop(act);
    g_.Drop(ul);
  } else {
    T ul = Linear(g_, m, up.w, up.b, up.in, up.out);
    hidden = Activation(ul);
    g_.Drop(ul);
  }
  g_.Drop(m);
  T n = Linear(g_, hidden, down.w, down.b, down.in, down.out);
  g_.Drop(hidden);
  T nd = Dropout(g_, n, a_.hidden_dropout);
  g_.Drop(n);
  T out = Add(g_, x2, nd);
  g_.Drop(nd);
  g_.Drop(x2);
  return out;
}

Result<T> ModelRun::FoundryForward() {
  // What the adapter runs as llm-foundry runs it; anything else is refused, not approximated.
  if (inv_.model_type != "mpt") {
    return Status::Unimplemented(inv_.name + ": the step model runs llm-foundry's MPT only (" +
                                 "model_type mpt), not " + inv_.model_type);
  }
  if (s_.lora_rank > 0) {
    return Status::Unimplemented("the step model runs llm-foundry's MPT for full training only");
  }
  // What the model below runs: MPTModel with attn_impl 'torch' and LPLayerNorm (plain
  // F.layer_norm, the same without autocast). llm-foundry's default attn_impl is 'flash'
  // (flash_attn's kernels), so a config that does not name 'torch' is not this model.
  if (a_.attention_impl != "torch") {
    return Status::Unimplemented(
        inv_.name + ": the step model runs llm-foundry's MPT with attn_config.attn_impl 'torch' " +
        "only (this config: '" +
        (a_.attention_impl.empty() ? "flash', the default" : a_.attention_impl + "'") +
        "; flash_attn's kernels are not modelled)");
  }
  const std::string& norm = a_.norm_type;
  if (!(norm.empty() || norm == "low_precision_layernorm" || (norm == "layernorm" && !autocast_))) {
    return Status::Unimplemented(inv_.name +
                                 ": the step model runs MPT's low_precision_layernorm, " +
                                 "not norm_type '" + norm + "'");
  }
  if (!a_.block_options.empty()) {
    std::string names;
    for (const std::string& o : a_.block_options) names += (names.empty() ? "" : ", ") + o;
    return Status::Unimplemented(inv_.name + ": the step model does not run MPT's " + names +
                                 " yet");
  }
  if (!a_.alibi && !a_.learned_positions) {
    return Status::Unimplemented(inv_.name +
                                 ": the step model runs llm-foundry's MPT with ALiBi or learned "
                                 "positions (not rope)");
  }
  for (const BlockParams& bp : blocks_) {
    if (!bp.has(TensorRole::kAttentionQkv) || !bp.has(TensorRole::kAttentionOut) ||
        !bp.has(TensorRole::kMlpUp) || !bp.has(TensorRole::kMlpDown) || bp.norms.size() != 2 ||
        !bp.qk_norms.empty()) {
      return Status::Unimplemented(inv_.name +
                                   ": the step model runs MPT blocks of norm_1, a fused Wqkv, "
                                   "out_proj, norm_2 and an MLP (no qk_ln)");
    }
  }
  if (final_norms_.empty()) {
    return Status::Unimplemented(inv_.name + ": the step model found no norm_f");
  }
  notes_.push_back(
      "llm-foundry's MPT run with attn_impl 'torch' (scaled_multihead_dot_product_attention), "
      "low_precision_layernorm and torch's cross-entropy, as memplan.trace traces it");
  const Wide h = static_cast<Wide>(a_.hidden);
  const Wide vocab = static_cast<Wide>(a_.vocab);
  if (a_.alibi) {
    // MPTModel._attn_bias: the ALiBi bias (1 x heads x 1 x max_seq_len, fp32), made by the first
    // step and kept on the module (not a registered buffer: the tracker counts it as an
    // activation present at the start of every later step).
    attn_bias_ = g_.New(
        static_cast<Wide>(a_.heads) * static_cast<Wide>(std::max<int64_t>(a_.max_positions, 1)),
        DT::kF32, false);
  }
  // MPTModel.forward: x = wte(input_ids) (+ wpe(pos) with learned positions), emb_drop.
  g_.SetWhere("embedding");
  T x = Embedding(g_, embedding_, tokens_, h, pdt_);
  if (a_.learned_positions && position_embedding_.ok()) {
    T pos = Embedding(g_, position_embedding_, seq_, h, pdt_);
    T xs = Add(g_, x, pos);
    g_.Drop(pos);
    g_.Drop(x);
    x = xs;
  }
  T xd = Dropout(g_, x, a_.embedding_dropout);
  g_.Drop(x);
  x = RunLayers(xd);
  g_.SetWhere("norm_f");
  T hn = FoundryNorm(final_norms_.back(), x);
  g_.Drop(x);
  // MPTForCausalLM.forward: lm_head, or the tied wte.unembed (F.linear with wte's weight).
  g_.SetWhere("lm_head");
  T logits =
      Linear(g_, hn, head_.ok() ? head_ : embedding_, head_.ok() ? head_bias_ : T{}, h, vocab);
  g_.Drop(hn);
  // ComposerMPTCausalLM.loss: targets = get_targets(labels) (torch.roll, then the last position
  // set to -100), nn.CrossEntropyLoss(reduction='none') over the flattened logits as they are
  // (CrossEntropyLoss: 16-bit log-probabilities under autocast, cast for nll_loss),
  // losses.sum() / (targets != -100).sum().
  g_.SetPhase(StepPhase::kLoss);
  g_.SetWhere("loss");
  T targets = g_.New(tokens_, DT::kI64, false);
  T per_token = CrossEntropyLoss(g_, logits, tokens_, vocab);
  T counted = g_.New(tokens_, DT::kBool, false);
  T count = g_.New(1, DT::kI64, false);
  g_.Drop(counted);
  T loss = Div(g_, per_token, count);
  g_.Drop(per_token);
  g_.Drop(count);
  g_.Drop(targets);
  g_.Drop(logits);
  g_.ClearAutocastCache();
  return loss;
}

}  // namespace memplan::estimator::step
