// Transformers' T5ForConditionalGeneration in the step model (Note [The step model] in
// step_model.h), as Transformers 5 runs it (models/t5/modeling_t5.py, integrations/
// sdpa_attention.py), trained on input_ids and labels only, as the tracer and the seq2seq
// fine-tuning scripts feed it: no attention masks, so the encoder's bidirectional mask, the
// decoder's causal mask under SDPA (is_causal) and the cross-attention's mask are all None, and
// the decoder's input ids are the labels shifted right (T5PreTrainedModel._shift_right).
//
// What is not modelled, and refused: the other T5 classes (T5Model, T5EncoderModel, the
// classification and question-answering heads), LoRA (PEFT's seq2seq wrapper), and a model
// without the stacks' relative position tables.
#include <string>

#include "estimator/step_blocks.h"
#include "estimator/step_ops.h"

namespace memplan::estimator::step {

bool ModelRun::T5ConditionalGeneration() const {
  return s_.framework == Framework::kTransformers && inv_.model_type == "t5" &&
         inv_.model_class == "seq2seq_lm" && a_.encoder_decoder;
}

// Note [T5's parameters]
// The family builder (hf_families_encoder.cc BuildT5) emits T5ForConditionalGeneration's
// parameters in named_parameters() order: the shared embedding, the encoder stack (its
// embed_tokens tied to the shared one, its blocks, its final_layer_norm), the decoder stack
// likewise, lm_head. Both stacks number their blocks from 0, so a block tensor's stack is told
// by the top-level norms before it: a block before the first final norm is the encoder's. Within
// a block the roles come in module order: the self-attention's q, k, v, o (block 0: and its
// relative_attention_bias), its layer_norm; in the decoder the cross-attention's q, k, v, o and
// layer_norm; then the feed-forward's wi (or wi_0, wi_1), wo and layer_norm.
Status ModelRun::PrepareT5(const AdapterMap& adapters) {
  t5_ = T5{};
  t5_.on = true;
  auto refuse = [&](const std::string& what) {
    return Status::Unimplemented(inv_.name + ": the step model runs T5ForConditionalGeneration " +
                                 "as Transformers builds it; it does not run " + what);
  };
  if (s_.lora_rank > 0) return refuse("LoRA (PEFT's seq2seq wrapper)");
  // T5Config.__post_init__: "for backwards compatibility", feed_forward_proj "gated-gelu" runs
  // dense_act_fn "gelu_new" (NewGELUActivation), not the exact gelu its name says.
  if (a_.gated_mlp && a_.hidden_act == "gelu") fam_.act = Family::Act::kGeluNew;
  t5_.encoder.blocks.assign(static_cast<size_t>(std::max<int64_t>(a_.layers, 0)), T5Block{});
  t5_.decoder.blocks.assign(static_cast<size_t>(std::max<int64_t>(a_.decoder_layers, 0)),
                            T5Block{});
  t5_.decoder.decoder = true;
  int final_norms = 0;
  for (size_t i = 0; i < inv_.tensors.size(); ++i) {
    const TensorInfo& t = inv_.tensors[i];
    const T p = params_[i];
    if (t.role == TensorRole::kClassifier) return refuse("a classification or QA head");
    if (t.block.empty()) {
      if (t.role == TensorRole::kNorm && !t.bias) {
        if (final_norms > 1) return refuse("a third stack");
        (final_norms == 0 ? t5_.encoder : t5_.decoder).final_norm =
            Norm{p, T{}, static_cast<Wide>(t.numel)};
        ++final_norms;
      }
      continue;
    }
    T5Stack& st = final_norms == 0 ? t5_.encoder : t5_.decoder;
    if (t.layer < 0 || static_cast<size_t>(t.layer) >= st.blocks.size()) {
      return refuse("a block beyond the config's layer count");
    }
    T5Block& b = st.blocks[static_cast<size_t>(t.layer)];
    // The cross-attention's projections are the second of each role in a decoder block.
    auto attention_lin = [&](Lin T5Attention::*member) -> Lin& {
      Lin& self = b.self.*member;
      return self.ok() && st.decoder ? b.cross.*member : self;
    };
    Lin* lin = nullptr;
    switch (t.role) {
      case TensorRole::kAttentionQ: lin = &attention_lin(&T5Attention::q); break;
      case TensorRole::kAttentionK: lin = &attention_lin(&T5Attention::k); break;
      case TensorRole::kAttentionV: lin = &attention_lin(&T5Attention::v); break;
      case TensorRole::kAttentionOut: lin = &attention_lin(&T5Attention::o); break;
      case TensorRole::kMlpGate: lin = &b.wi; break;
      case TensorRole::kMlpUp: lin = a_.gated_mlp ? &b.wi_1 : &b.wi; break;
      case TensorRole::kMlpDown: lin = &b.wo; break;
      case TensorRole::kRelativeAttentionBias:
        if (t.layer != 0) return refuse("a relative position table beyond block 0");
        st.relative_bias = p;
        break;
      case TensorRole::kNorm: {
        // Each sublayer's norm follows its module's projections.
        Norm n{p, T{}, static_cast<Wide>(t.numel)};
        if (b.wo.ok()) {
          b.ff_norm = n;
        } else if (b.cross.o.ok()) {
          b.cross.norm = n;
        } else {
          b.self.norm = n;
        }
        break;
      }
      default: return refuse("a " + std::string(TensorRoleName(t.role)) + " tensor in a block");
    }
    if (lin != nullptr && t.IsLinearWeight()) AssignLinearWeight(lin, t, p, adapters);
  }
  for (T5Stack* st : {&t5_.encoder, &t5_.decoder}) {
    if (!st->relative_bias.ok() || !st->final_norm.w.ok()) {
      return refuse("a stack without its relative position table or final norm");
    }
    for (const T5Block& b : st->blocks) {
      const bool self_ok =
          b.self.q.ok() && b.self.k.ok() && b.self.v.ok() && b.self.o.ok() && b.self.norm.w.ok();
      const bool cross_ok = !st->decoder || (b.cross.q.ok() && b.cross.k.ok() && b.cross.v.ok() &&
                                             b.cross.o.ok() && b.cross.norm.w.ok());
      const bool ff_ok =
          b.wi.ok() && b.wo.ok() && (b.wi_1.ok() == a_.gated_mlp) && b.ff_norm.w.ok();
      if (!self_ok || !cross_ok || !ff_ok) return refuse("a block missing T5's sublayers");
    }
  }
  if (!head_.ok()) return refuse("a model without lm_head");
  return Status::Ok();
}

T ModelRun::T5LayerNorm(const Norm& n, T x) {
  // T5LayerNorm.forward:
  //   variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
  //   hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
  //   if self.weight.dtype in [torch.float16, torch.bfloat16]:
  //       hidden_states = hidden_states.to(self.weight.dtype)
  //   return self.weight * hidden_states
  // The input itself (not its fp32 copy) is multiplied; `variance` lives until the return.
  T h32 = Cast(g_, x, DT::kF32);
  T p = Apply(g_, Unary::kPow, h32);
  g_.Drop(h32);
  T var = MeanRows(g_, p, n.width);
  g_.Drop(p);
  T eps = Scale(g_, var);
  T r = Apply(g_, Unary::kRsqrt, eps);
  g_.Drop(eps);
  T hn = Mul(g_, x, r);
  g_.Drop(r);
  if (Half(g_.Dtype(n.w))) {
    T hc = Cast(g_, hn, g_.Dtype(n.w));
    g_.Drop(hn);
    hn = hc;
  }
  T out = Mul(g_, n.w, hn);
  g_.Drop(hn);
  g_.Drop(var);
  return out;
}

T ModelRun::T5PositionBias(const T5Stack& st) {
  // T5Attention.compute_bias (block 0's self-attention; the later blocks reuse its result):
  //   context_position = torch.arange(query_length)[:, None] + past_seen_tokens
  //   memory_position = torch.arange(key_length)[None, :]
  //   relative_position = memory_position - context_position
  //   relative_position_bucket = self._relative_position_bucket(relative_position, ...)
  //   values = self.relative_attention_bias(relative_position_bucket)
  //   values = values.permute([2, 0, 1]).unsqueeze(0)
  // _relative_position_bucket's int64 and fp32 seq x seq temporaries (the encoder's
  // bidirectional buckets, the decoder's -min(relative_position, 0)), its is_small mask and the
  // logarithmic buckets; the embedding saves the buckets. The result is a permuted view of the
  // embedding's output (seq x seq x heads, in the table's dtype).
  const Wide ss = seq_ * seq_;
  T context = g_.New(seq_, DT::kI64, false);
  T memory = g_.New(seq_, DT::kI64, false);
  T relative = g_.New(ss, DT::kI64, false);
  T buckets;
  T distance;  // |relative| (encoder) or -min(relative, 0) (decoder)
  if (!st.decoder) {
    T gt = g_.New(ss, DT::kBool, false);
    T lng = g_.New(ss, DT::kI64, false);
    T mul = g_.New(ss, DT::kI64, false);
    g_.Drop(gt);
    g_.Drop(lng);
    buckets = g_.New(ss, DT::kI64, false);  // 0 + ... (a new tensor)
    g_.Drop(mul);
    distance = g_.New(ss, DT::kI64, false);  // abs
  } else {
    T zeros = g_.New(ss, DT::kI64, false);
    T minimum = g_.New(ss, DT::kI64, false);
    g_.Drop(zeros);
    distance = g_.New(ss, DT::kI64, false);  // neg
    g_.Drop(minimum);
  }
  T small = g_.New(ss, DT::kBool, false);
  // max_exact + (log(relative.float() / max_exact) / log(...) * (num_buckets - max_exact)).long()
  T f = g_.New(ss, DT::kF32, false);
  for (int i = 0; i < 4; ++i) {  // / max_exact, log, / log(...), * (...)
    T next = g_.New(ss, DT::kF32, false);
    g_.Drop(f);
    f = next;
  }
  T large_long = g_.New(ss, DT::kI64, false);
  g_.Drop(f);
  T large = g_.New(ss, DT::kI64, false);
  g_.Drop(large_long);
  T full = g_.New(ss, DT::kI64, false);
  T clamped = g_.New(ss, DT::kI64, false);  // torch.min(large, full_like(large, num_buckets - 1))
  g_.Drop(full);
  g_.Drop(large);
  T where = g_.New(ss, DT::kI64, false);
  g_.Drop(clamped);
  g_.Drop(small);
  g_.Drop(distance);
  if (st.decoder) {
    buckets = g_.New(ss, DT::kI64, false);  // 0 + where(...)
    g_.Drop(where);
  } else {
    g_.Drop(where);  // relative_buckets += where(...): in place
  }
  const T table = st.relative_bias;
  T values = g_.New(ss * static_cast<Wide>(a_.heads), g_.Dtype(table), g_.RequiresGrad(table));
  Graph::NodeSpec spec = Graph::Spec("Embedding", {table}, {values});
  // Under a checkpointed block 0 the embedding's saved indices are the checkpoint's to recompute.
  const bool ckpt = Checkpointed(st.decoder ? static_cast<int>(a_.layers) : 0);
  if (g_.RequiresGrad(table) && !ckpt) spec.saved = {buckets};
  g_.Record(std::move(spec));
  g_.Drop(buckets);
  g_.Drop(relative);
  g_.Drop(context);
  g_.Drop(memory);
  return values;
}

T ModelRun::T5EagerAttention(T q, T k, T v, T bias, T mask, bool folded_kv) {
  // eager_attention_forward (modeling_t5.py):
  //   attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling   # scaling = 1.0
  //   attn_weights = attn_weights + position_bias
  //   if attention_mask is not None: attn_weights = attn_weights + attention_mask
  //   attn_weights = nn.functional.softmax(attn_weights, dim=-1)
  //   attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
  //   attn_output = torch.matmul(attn_weights, value)
  //   attn_output = attn_output.transpose(1, 2).contiguous()
  // matmul folds batch and heads with a reshape, which copies a transposed projection (the
  // query, and the key and value unless the cache's cat made them contiguous); bmm saves its
  // operands. softmax is an fp32 op under autocast; the bias (fp32 from the table) promotes.
  const Wide heads = static_cast<Wide>(a_.heads), d = static_cast<Wide>(a_.head_dim);
  auto fold = [&](T t, bool copy) {
    T a = AutocastIn(g_, t);
    if (!copy) return a;
    T c = Copy(g_, a);
    g_.Drop(a);
    return c;
  };
  T qc = fold(q, true), kc = fold(k, !folded_kv);
  T scores = AutocastBmm(g_, "Matmul(qk)", qc, kc, batch_ * heads * seq_ * seq_);
  T scaled = Scale(g_, scores);
  g_.Drop(scores);
  T biased = Add(g_, scaled, bias);
  g_.Drop(scaled);
  if (mask.ok()) {
    T masked = Add(g_, biased, mask);
    g_.Drop(biased);
    biased = masked;
  }
  T probs = Softmax(g_, biased, autocast_ ? DT::kF32 : g_.Dtype(biased));
  g_.Drop(biased);
  T dropped = Dropout(g_, probs, a_.attention_dropout);
  g_.Drop(probs);
  T pa = AutocastIn(g_, dropped);
  g_.Drop(dropped);
  T vc = fold(v, !folded_kv);
  T o = AutocastBmm(g_, "Matmul(pv)", pa, vc, batch_ * heads * seq_ * d);
  T out = Copy(g_, o);
  g_.Drop(o);
  return out;
}

T ModelRun::T5AttentionForward(T5Stack& st, const T5Attention& at, T h, bool cross) {
  // T5Attention.forward: q from the normed hidden states, k and v from them or (cross-attention)
  // from the encoder's output; the decoder's EncoderDecoderCache (use_cache from the config,
  // unless the block is checkpointed) copies keys and values (DynamicLayer.update's cat); the
  // position bias: block 0's compute_bias (made before the block, T5PositionBias), or for the
  // cross-attention a torch.zeros((1, heads, q_len, k_len)) in the query's dtype, made in block
  // 0 and passed on, requiring grad when gradient checkpointing trains.
  const Wide heads = static_cast<Wide>(a_.heads), d = static_cast<Wide>(a_.head_dim);
  const T src = cross ? t5_.encoder_out : h;
  T q = LoraLinear(at.q, h);
  T k = LoraLinear(at.k, src);
  T v = LoraLinear(at.v, src);
  const bool cached = st.decoder && use_cache_;
  if (cached) CacheUpdate(&k, &v);
  T bias = cross ? st.cross_bias : st.bias;
  if (cross && !bias.ok()) {
    st.cross_bias = g_.New(heads * seq_ * seq_, g_.Dtype(q), false);
    if (s_.checkpointing == Checkpointing::kFull) {
      g_.SetRequiresGrad(st.cross_bias, true);
      t5_.cross_leaf = st.cross_bias;
    }
    bias = st.cross_bias;
  }
  const bool causal = st.decoder && !cross;
  T out;
  if (!s_.flash_attention) {
    out = T5EagerAttention(q, k, v, bias, causal ? st.mask : T{}, cached);
  } else {
    // sdpa_attention_forward with a position bias: create_position_bias_mask makes the SDPA
    // mask, torch.where(causal_mask, position_bias, min_dtype) for the decoder's self-attention
    // (is_causal, no mask: the causal mask from two aranges, which WhereBackward saves) or the
    // bias itself, then .contiguous() (a copy of the permuted bias or of where's output, which
    // follows it). SDPA's autocast casts an fp32 mask to the query's dtype. The float mask
    // sends SDPA to the memory-efficient kernel, which saves it and, when it requires grad,
    // computes its gradient at batch x heads x q_len x k_len before autograd sums the batch.
    T mask;
    if (causal) {
      T ar1 = g_.New(seq_, DT::kI64, false);
      T ar2 = g_.New(seq_, DT::kI64, false);
      T cond = g_.New(seq_ * seq_, DT::kBool, false);
      g_.Drop(ar1);
      g_.Drop(ar2);
      T min = g_.New(1, DT::kF32, false);
      T where = g_.New(g_.Numel(bias), g_.Dtype(bias), g_.RequiresGrad(bias));
      Graph::NodeSpec spec = Graph::Spec("Where", {bias}, {where}, {cond});
      g_.Record(std::move(spec));
      g_.Drop(min);
      g_.Drop(cond);
      mask = Copy(g_, where);
      g_.Drop(where);
    } else if (cross) {
      mask = g_.Alias(bias);  // torch.zeros is contiguous
    } else {
      mask = Copy(g_, bias);
    }
    T mc = AutocastIn(g_, mask);
    g_.Drop(mask);
    T qc = AutocastIn(g_, q), kc = AutocastIn(g_, k), vc = AutocastIn(g_, v);
    const DT dt = g_.Dtype(qc);
    const Wide rows = batch_ * heads * seq_;
    out = g_.New(rows * d, dt, true);
    Graph::NodeSpec spec = Graph::Spec("Sdpa(efficient)", {qc, kc, vc, mc}, {out});
    T lse = g_.New(batch_ * heads * ((seq_ + 31) / 32 * 32), DT::kF32, false);
    T seed = g_.New(1, DT::kI64, false);
    T offset = g_.New(1, DT::kI64, false);
    spec.saved = {qc, kc, vc, out, lse, seed, offset, mc};
    if (g_.RequiresGrad(mc)) spec.extra = {{rows * seq_, g_.Dtype(mc)}};
    g_.Record(std::move(spec));
    g_.Drop(lse);
    g_.Drop(seed);
    g_.Drop(offset);
    g_.Drop(qc);
    g_.Drop(kc);
    g_.Drop(vc);
    g_.Drop(mc);
  }
  g_.Drop(q);
  g_.Drop(k);
  g_.Drop(v);
  T o = LoraLinear(at.o, out);
  g_.Drop(out);
  return o;
}

T ModelRun::T5FeedForward(const T5Block& b, T h) {
  // T5DenseGatedActDense: act(wi_0(h)) * wi_1(h), dropout, wo; T5DenseActDense: act(wi(h)),
  // dropout, wo. Both cast the product to wo's dtype first when they differ
  //   if hidden_states.dtype != self.wo.weight.dtype: hidden_states = hidden_states.to(...)
  // (under autocast a 16-bit product becomes an fp32 copy, which wo's autocast casts back).
  // The activation is dense_act_fn (gated-gelu: gelu_new, NewGELUActivation).
  T act;
  if (b.wi_1.ok()) {
    T gate = LoraLinear(b.wi, h);
    T ag = Activation(gate);
    g_.Drop(gate);
    T up = LoraLinear(b.wi_1, h);
    act = Mul(g_, ag, up);
    g_.Drop(ag);
    g_.Drop(up);
  } else {
    T up = LoraLinear(b.wi, h);
    act = Activation(up);
    g_.Drop(up);
  }
  T dropped = Dropout(g_, act, a_.hidden_dropout);
  g_.Drop(act);
  const DT wo_dt = g_.Dtype(b.wo.w);
  T cast = Cast(g_, dropped, wo_dt);
  g_.Drop(dropped);
  T out = LoraLinear(b.wo, cast);
  g_.Drop(cast);
  return out;
}

T ModelRun::T5BlockForward(T5Stack& st, int layer, T x) {
  // T5Block.forward: T5LayerSelfAttention (x + dropout(attn(layer_norm(x)))), the decoder's
  // T5LayerCrossAttention (the same over the encoder's output), T5LayerFF
  // (x + dropout(ff(layer_norm(x)))). The fp16 clamps only read the hidden states (an isinf
  // reduction), keeping nothing.
  const T5Block& b = st.blocks[static_cast<size_t>(layer)];
  const double p = a_.hidden_dropout;
  auto sublayer = [&](T in, auto&& branch) {
    T branch_out = branch(in);
    T dropped = Dropout(g_, branch_out, p);
    g_.Drop(branch_out);
    T sum = Add(g_, in, dropped);
    g_.Drop(dropped);
    return sum;
  };
  T x1 = sublayer(x, [&](T in) {
    T h = T5LayerNorm(b.self.norm, in);
    T a = T5AttentionForward(st, b.self, h, false);
    g_.Drop(h);
    return a;
  });
  if (st.decoder) {
    T x2 = sublayer(x1, [&](T in) {
      T h = T5LayerNorm(b.cross.norm, in);
      T a = T5AttentionForward(st, b.cross, h, true);
      g_.Drop(h);
      return a;
    });
    g_.Drop(x1);
    x1 = x2;
  }
  T out = sublayer(x1, [&](T in) {
    T h = T5LayerNorm(b.ff_norm, in);
    T f = T5FeedForward(b, h);
    g_.Drop(h);
    return f;
  });
  g_.Drop(x1);
  return out;
}

T ModelRun::T5RunBlock(T5Stack& st, int layer, T x) {
  // GradientCheckpointingLayer numbers the blocks of both stacks in module order (encoder
  // first) for every_n_layers, and drops the block's past_key_values (no cache in it).
  const int index = st.decoder ? static_cast<int>(a_.layers) + layer : layer;
  if (!Checkpointed(index)) return T5BlockForward(st, layer, x);
  const bool cache = use_cache_;
  use_cache_ = false;
  g_.SetSaving(false);
  T out = T5BlockForward(st, layer, x);
  g_.SetSaving(true);
  // The recompute runs in backward, when the stack's forward tensors are no longer its own:
  // they are the checkpoint's (held until it has run).
  T5Stack* stack = &st;
  const T bias = st.bias, cross_bias = st.cross_bias, mask = st.mask;
  const T encoder_out = st.decoder ? t5_.encoder_out : T{};
  g_.RecordCheckpoint(x, out,
                      [this, stack, layer, bias, cross_bias, mask, encoder_out](T in) {
                        const bool c = use_cache_;
                        use_cache_ = false;
                        stack->bias = bias;
                        stack->cross_bias = cross_bias;
                        stack->mask = mask;
                        t5_.encoder_out = encoder_out;
                        T o = T5BlockForward(*stack, layer, in);
                        stack->bias = stack->cross_bias = stack->mask = T{};
                        t5_.encoder_out = T{};
                        use_cache_ = c;
                        return o;
                      },
                      {bias, cross_bias, mask, encoder_out});
  use_cache_ = cache;
  return out;
}

T ModelRun::T5RunStack(T5Stack& st, T x) {
  // T5Stack.forward: dropout(inputs_embeds), the blocks (block 0 makes the position biases the
  // others reuse), final_layer_norm, dropout. The eager decoder's causal mask
  // (create_causal_mask: batch x 1 x seq x seq in the embeddings' dtype) is made first.
  const std::string name = st.decoder ? "decoder" : "encoder";
  g_.SetWhere(name + " embedding");
  if (st.decoder && !s_.flash_attention) {
    T cond = g_.New(seq_ * seq_, DT::kBool, false);
    T min = g_.New(1, DT::kF32, false);
    st.mask = g_.New(batch_ * seq_ * seq_, g_.Dtype(x), false);
    g_.Drop(cond);
    g_.Drop(min);
  }
  T h = Dropout(g_, x, a_.embedding_dropout);
  g_.Drop(x);
  for (size_t i = 0; i < st.blocks.size(); ++i) {
    g_.SetWhere(name + " layer " + std::to_string(i));
    if (i == 0) st.bias = T5PositionBias(st);
    T next = T5RunBlock(st, static_cast<int>(i), h);
    g_.Drop(h);
    h = next;
  }
  g_.SetWhere(name + " final norm");
  T normed = T5LayerNorm(st.final_norm, h);
  g_.Drop(h);
  T out = Dropout(g_, normed, a_.hidden_dropout);
  g_.Drop(normed);
  g_.Drop(st.bias);
  g_.Drop(st.cross_bias);
  g_.Drop(st.mask);
  st.bias = st.cross_bias = st.mask = T{};
  return out;
}

Result<T> ModelRun::T5Forward() {
  // T5ForConditionalGeneration.forward: the encoder over input_ids, the labels shifted right as
  // the decoder's input ids, the decoder over them with the encoder's output, the decoder's
  // output scaled by d_model**-0.5 when scale_decoder_outputs, lm_head, then
  //   loss_fct = CrossEntropyLoss(ignore_index=-100)
  //   loss = loss_fct(lm_logits.view(-1, lm_logits.size(-1)), labels.view(-1))
  // on the logits as they are (CrossEntropyLoss in step_ops.h).
  const Wide h = static_cast<Wide>(a_.hidden), vocab = static_cast<Wide>(a_.vocab);
  const bool ckpt = s_.checkpointing == Checkpointing::kFull;
  use_cache_ = a_.use_cache;
  explicit_mask_ = false;
  g_.SetWhere("encoder embedding");
  T x = Embedding(g_, embedding_, tokens_, h, pdt_);
  if (ckpt) g_.SetRequiresGrad(x, true);
  t5_.encoder_out = T5RunStack(t5_.encoder, x);
  // _shift_right: input_ids.new_zeros(shape); [..., 1:] = input_ids[..., :-1].clone();
  // [..., 0] = start; masked_fill_(shifted == -100, pad) (the eq's bool mask a temporary).
  g_.SetWhere("shift right");
  T shifted = g_.New(tokens_, DT::kI64, false);
  T part = g_.New(batch_ * (seq_ - 1), DT::kI64, false);
  g_.Drop(part);
  T eq = g_.New(tokens_, DT::kBool, false);
  g_.Drop(eq);
  g_.SetWhere("decoder embedding");
  T y = g_.New(tokens_ * h, pdt_, g_.RequiresGrad(embedding_));
  Graph::NodeSpec spec = Graph::Spec("Embedding", {embedding_}, {y});
  if (g_.RequiresGrad(embedding_)) spec.saved = {shifted};
  g_.Record(std::move(spec));
  g_.Drop(shifted);
  if (ckpt) g_.SetRequiresGrad(y, true);
  // Recorded before the decoder's ops, this hook runs after all their backward: the
  // cross-attention bias (a leaf, made in decoder block 0) and its .grad are gone by then, not
  // kept into the optimizer step.
  t5_.cross_leaf = T{};
  g_.RecordHook([this] {
    if (!t5_.cross_leaf.ok()) return;
    const int grad = g_.TakeGrad(t5_.cross_leaf);
    if (grad >= 0) g_.Unref(grad);
  });
  // decoder_outputs (its last_hidden_state) and sequence_output (scaled when the embeddings are
  // tied) are locals of the forward, which computes the loss.
  T decoder_out = T5RunStack(t5_.decoder, y);
  T seq_out = a_.scale_decoder_output ? Scale(g_, decoder_out) : g_.Alias(decoder_out);
  g_.SetWhere("lm_head");
  T logits = Linear(g_, seq_out, head_, head_bias_, h, vocab);
  g_.SetPhase(StepPhase::kLoss);
  g_.SetWhere("loss");
  T loss = CrossEntropyLoss(g_, logits, tokens_, vocab);
  // The training loop keeps `.loss` only: the logits, the cache and the encoder's output go.
  g_.Drop(logits);
  g_.Drop(seq_out);
  g_.Drop(decoder_out);
  g_.Drop(t5_.encoder_out);
  t5_.encoder_out = T{};
  for (T c : cache_) g_.Drop(c);
  cache_.clear();
  g_.ClearAutocastCache();
  return loss;
}

}  // namespace memplan::estimator::step
