// Transformers' encoder masked LMs and classifiers in the step model (Note [The step model] in
// step_model.h): BertForMaskedLM, RobertaForMaskedLM, XLMRobertaForMaskedLM and
// DistilBertForMaskedLM, and their ForSequenceClassification and ForTokenClassification, as
// Transformers 5 runs them (models/bert/modeling_bert.py, roberta/modeling_roberta.py,
// xlm_roberta/modeling_xlm_roberta.py, distilbert/modeling_distilbert.py), trained on input_ids
// and labels only, as the tracer and most fine-tuning scripts feed them: no attention mask, so
// create_bidirectional_mask returns None (no padding to mask) for SDPA and eager alike, and the
// masked-LM loss runs over every token.
//
// What is not modelled, and refused: the pre-training heads (next-sentence prediction), BERT as a
// decoder (is_decoder, cross-attention), relative position embeddings, the other task heads
// (question answering, multiple choice) and a one-label sequence classifier (a regression, whose
// MSELoss takes float labels).
//
// Note [Encoder classifiers in the step model]
// The sequence classifiers read the first token's hidden state, a select view of the last layer's
// output (its backward makes a gradient of the whole output): BertForSequenceClassification
// through BertPooler (dense, tanh), then dropout and the classifier; RobertaClassificationHead
// (XLM-RoBERTa's too): dropout, dense, tanh, dropout, out_proj;
// DistilBertForSequenceClassification: pre_classifier, ReLU, dropout (seq_classif_dropout),
// classifier. The token classifiers run dropout and the classifier on every token. The loss is
// CrossEntropyLoss over batch or token rows of num_labels (single_label_classification: integer
// labels, more than one label), and the labels the batch holds are batch x 1 for sequences
// (memory_model.cc counts them).
#include <string>

#include "estimator/step_blocks.h"
#include "estimator/step_ops.h"

namespace memplan::estimator::step {

namespace {
bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

bool ModelRun::EncoderMaskedLm() const {
  const std::string& type = inv_.model_type;
  const bool head = inv_.model_class == "masked_lm" ||
                    EndsWith(inv_.architecture, "ForSequenceClassification") ||
                    EndsWith(inv_.architecture, "ForTokenClassification");
  return s_.framework == Framework::kTransformers && head && !a_.causal && !a_.encoder_decoder &&
         (type == "bert" || type == "roberta" || type == "xlm-roberta" || type == "distilbert");
}

// The parameters the blocks' roles leave open: the segment table, the MLM head's transform and
// its norm, and the embeddings' norm. Both norms are top-level LayerNorms of the hidden width;
// the family builders emit the head's right after its dense transform (Note [Tensor roles]), so
// a norm that follows a head_transform tensor is the head's.
Status ModelRun::PrepareEncoder(const AdapterMap& adapters) {
  enc_ = Encoder{};
  enc_.on = true;
  const std::string& type = inv_.model_type;
  enc_.distil = type == "distilbert";
  enc_.roberta_positions = type == "roberta" || type == "xlm-roberta";
  enc_.head_gelu = enc_.roberta_positions;
  enc_.task = EndsWith(inv_.architecture, "ForSequenceClassification") ? Encoder::Task::kSequence
              : EndsWith(inv_.architecture, "ForTokenClassification")  ? Encoder::Task::kToken
                                                                       : Encoder::Task::kMaskedLm;
  const bool mlm = enc_.task == Encoder::Task::kMaskedLm;
  auto refuse = [&](const std::string& what) {
    return Status::Unimplemented(inv_.name + ": the step model runs " + inv_.model_type +
                                 "'s masked-LM head and its sequence and token classifiers on the "
                                 "plain encoder; it does not run " +
                                 what);
  };
  // A Linear of the head (weight, then its bias), with its LoRA adapters.
  auto head_linear = [&](Lin* l, const TensorInfo& t, T p) {
    if (t.IsLinearWeight()) {
      AssignLinearWeight(l, t, p, adapters);
    } else if (t.bias) {
      l->b = p;
    }
  };
  bool after_transform = false;
  for (size_t i = 0; i < inv_.tensors.size(); ++i) {
    const TensorInfo& t = inv_.tensors[i];
    const T p = params_[i];
    if ((t.role == TensorRole::kPooler || t.role == TensorRole::kClassifier) && mlm) {
      return refuse("a pooler or a classifier (BertForPreTraining's next-sentence head)");
    }
    if (t.role == TensorRole::kPooler) {
      head_linear(&enc_.pooler, t, p);
      continue;
    }
    if (t.role == TensorRole::kClassifier) {
      if (t.IsLinearWeight()) enc_.classifiers.emplace_back();
      if (enc_.classifiers.empty()) return refuse("a classifier bias without its weight");
      head_linear(&enc_.classifiers.back(), t, p);
      continue;
    }
    if (!t.block.empty()) {
      if (t.role == TensorRole::kPositionEmbedding) {
        return refuse("relative position embeddings (distance_embedding)");
      }
      continue;
    }
    switch (t.role) {
      case TensorRole::kTokenTypeEmbedding: enc_.token_type = p; break;
      case TensorRole::kHeadTransform: head_linear(&enc_.transform, t, p); break;
      case TensorRole::kNorm: {
        Norm& n = after_transform ? enc_.head_norm : enc_.embedding_norm;
        if (t.bias) {
          n.b = p;
        } else {
          n.w = p;
          n.width = static_cast<Wide>(t.numel);
        }
        break;
      }
      default: break;
    }
    if (t.role != TensorRole::kNorm) after_transform = t.role == TensorRole::kHeadTransform;
  }
  if (mlm && (!enc_.transform.ok() || !enc_.head_norm.w.ok() || !head_.ok())) {
    return refuse("a masked LM without its head's transform, norm or decoder");
  }
  if (!enc_.embedding_norm.w.ok() || !position_embedding_.ok()) {
    return refuse("a model without the embeddings' norm or position table");
  }
  if (!mlm) {
    const bool bert = inv_.model_type == "bert";
    const size_t want = enc_.task == Encoder::Task::kToken || bert ? 1 : 2;
    if (enc_.classifiers.size() != want ||
        (enc_.task == Encoder::Task::kSequence && bert) != enc_.pooler.ok()) {
      return refuse("this head's layout (" + std::to_string(enc_.classifiers.size()) +
                    " classifier Linears" + (enc_.pooler.ok() ? ", a pooler" : "") + ")");
    }
    if (enc_.classifiers.back().out < 2) {
      return refuse("a one-label classifier (a regression: MSELoss on float labels)");
    }
  }
  for (const BlockParams& bp : blocks_) {
    for (TensorRole r : {TensorRole::kAttentionQ, TensorRole::kAttentionK, TensorRole::kAttentionV,
                         TensorRole::kAttentionOut, TensorRole::kMlpUp, TensorRole::kMlpDown}) {
      if (!bp.has(r)) return refuse("a block without " + std::string(TensorRoleName(r)));
    }
    // A decoder's cross-attention adds a third LayerNorm (and repeats the projections).
    if (bp.norms.size() != 2) return refuse("cross-attention, or a block without two LayerNorms");
  }
  return Status::Ok();
}

// nn.Embedding over `rows` indices: F.embedding saves the indices (`ids`, when the model made
// them; the batch's input_ids are the step's, already counted).
T ModelRun::EncoderLookup(T table, Wide rows, T ids) {
  T y = g_.New(rows * static_cast<Wide>(a_.hidden), pdt_, g_.RequiresGrad(table));
  Graph::NodeSpec spec = Graph::Spec("Embedding", {table}, {y});
  if (ids.ok() && g_.RequiresGrad(table)) spec.saved = {ids};
  g_.Record(std::move(spec));
  return y;
}

T ModelRun::EncoderEmbeddings() {
  // BertEmbeddings.forward: position ids a slice of the position_ids buffer (1 x seq); token
  // type ids gathered from the token_type_ids buffer at those positions (a 1 x seq int64
  // tensor) and expanded to the batch; word + token type, + position (broadcast over the
  // batch), LayerNorm, dropout.
  // RobertaEmbeddings.forward: position ids from the input ids (create_position_ids_from_input_ids:
  //   mask = input_ids.ne(padding_idx).int()
  //   incremental_indices = (torch.cumsum(mask, dim=1).type_as(mask) + past) * mask
  //   return incremental_indices.long() + padding_idx
  // a batch x seq int64 tensor), the token type ids gathered at them (batch x seq), so the
  // position embedding is batch x seq too.
  // DistilBERT's Embeddings.forward: word + position (the buffer's slice), LayerNorm, dropout.
  T positions, types;
  if (enc_.roberta_positions) {
    T ne = g_.New(tokens_, DT::kBool, false);
    T mask = g_.New(tokens_, DT::kI32, false);
    g_.Drop(ne);
    T cumsum = g_.New(tokens_, DT::kI64, false);  // cumsum of an int tensor is int64
    T typed = g_.New(tokens_, DT::kI32, false);
    g_.Drop(cumsum);
    T shifted = g_.New(tokens_, DT::kI32, false);
    g_.Drop(typed);
    T masked = g_.New(tokens_, DT::kI32, false);
    g_.Drop(shifted);
    g_.Drop(mask);
    T wide = g_.New(tokens_, DT::kI64, false);
    g_.Drop(masked);
    positions = g_.New(tokens_, DT::kI64, false);
    g_.Drop(wide);
  }
  if (enc_.token_type.ok()) {
    types = g_.New(enc_.roberta_positions ? tokens_ : seq_, DT::kI64, false);  // torch.gather
  }
  T x = Embedding(g_, embedding_, tokens_, static_cast<Wide>(a_.hidden), pdt_);
  // enable_input_require_grads hooks word_embeddings, inside the embeddings module.
  HoldEmbeddingLeaf(x);
  if (enc_.token_type.ok()) {
    T tt = EncoderLookup(enc_.token_type, tokens_, types);
    g_.Drop(types);
    T sum = Add(g_, x, tt);
    g_.Drop(x);
    g_.Drop(tt);
    x = sum;
  }
  T pos = EncoderLookup(position_embedding_, enc_.roberta_positions ? tokens_ : seq_, positions);
  g_.Drop(positions);
  T sum = Add(g_, x, pos);
  g_.Drop(x);
  g_.Drop(pos);
  const Norm& n = enc_.embedding_norm;
  T normed = LayerNorm(g_, sum, n.w, n.b, n.width);
  g_.Drop(sum);
  T out = Dropout(g_, normed, a_.embedding_dropout);
  g_.Drop(normed);
  return out;
}

T ModelRun::EncoderEagerAttention(T q, T k, T v) {
  // eager_attention_forward (modeling_bert.py, modeling_distilbert.py):
  //   attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
  //   attn_weights = nn.functional.softmax(attn_weights, dim=-1)
  //   attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
  //   attn_output = torch.matmul(attn_weights, value)
  //   attn_output = attn_output.transpose(1, 2).contiguous()
  // The query, key and value are transposed views of the projections (batch x seq x heads x d
  // in memory): matmul folds batch and heads with a reshape, which copies each, and bmm saves
  // the copies. softmax is an fp32 op under autocast (fp32 probabilities, dropped out in fp32),
  // cast back to the autocast dtype by the second matmul.
  const Wide heads = static_cast<Wide>(a_.heads), d = static_cast<Wide>(a_.head_dim);
  auto folded = [&](T t) {
    T a = AutocastIn(g_, t);
    T c = Copy(g_, a);
    g_.Drop(a);
    return c;
  };
  T qc = folded(q), kc = folded(k);
  T scores = AutocastBmm(g_, "Matmul(qk)", qc, kc, batch_ * heads * seq_ * seq_);
  T scaled = Scale(g_, scores);
  g_.Drop(scores);
  T probs = Softmax(g_, scaled, autocast_ ? DT::kF32 : g_.Dtype(scaled));
  g_.Drop(scaled);
  T dropped = Dropout(g_, probs, a_.attention_dropout);
  g_.Drop(probs);
  T pa = AutocastIn(g_, dropped);
  g_.Drop(dropped);
  T vc = folded(v);
  T o = AutocastBmm(g_, "Matmul(pv)", pa, vc, batch_ * heads * seq_ * d);
  T out = Copy(g_, o);
  g_.Drop(o);
  return out;
}

T ModelRun::EncoderAttention(const BlockParams& bp, T h) {
  // BertSelfAttention.forward / DistilBertSelfAttention.forward: query, key and value
  // projections viewed as batch x heads x seq x d, the attention interface, the heads merged
  // back (reshape + contiguous: no copy of the interface's contiguous output).
  QkvViews t;
  t.q = LoraLinear(bp.at(TensorRole::kAttentionQ), h);
  t.k = LoraLinear(bp.at(TensorRole::kAttentionK), h);
  t.v = LoraLinear(bp.at(TensorRole::kAttentionV), h);
  T out;
  if (s_.flash_attention) {
    AttentionShape as = SelfAttentionShape(static_cast<Wide>(a_.heads), static_cast<Wide>(a_.heads),
                                           static_cast<Wide>(a_.head_dim));
    as.dropout = a_.attention_dropout;
    as.mask = false;
    as.causal = false;
    out = TransformersSdpa(as, autocast_ ? adt_ : g_.Dtype(t.q), &t);
  } else {
    out = EncoderEagerAttention(t.q, t.k, t.v);
  }
  g_.Drop(t.q);
  g_.Drop(t.k);
  g_.Drop(t.v);
  return out;
}

T ModelRun::EncoderBlock(int layer, T x) {
  // BertLayer.forward (RobertaLayer, XLMRobertaLayer: the same code):
  //   BertAttention: self-attention, then BertSelfOutput: LayerNorm(dropout(dense(a)) + x)
  //   feed_forward_chunk: BertIntermediate act(dense(a)), then BertOutput:
  //     LayerNorm(dropout(dense(i)) + a)
  // DistilBERT's TransformerBlock.forward: sa_layer_norm(out_lin(attn) + x) (no dropout on the
  // attention output), then output_layer_norm(dropout(lin2(act(lin1(a)))) + a).
  // Locals that outlive what saves them (what a frozen LoRA base does not save): BertAttention's
  // self_outputs (the attention's context) through BertSelfOutput and its norm, and
  // feed_forward_chunk's intermediate_output through BertOutput and its norm. DistilBERT's
  // attention and FFN modules return before their norms run, freeing theirs.
  const BlockParams& bp = blocks_[static_cast<size_t>(layer)];
  const double p = a_.hidden_dropout;
  T ctx = EncoderAttention(bp, x);
  T o = LoraLinear(bp.at(TensorRole::kAttentionOut), ctx);
  if (enc_.distil) g_.Drop(ctx);
  if (!enc_.distil) {
    T od = Dropout(g_, o, p);
    g_.Drop(o);
    o = od;
  }
  // LayerNorm(hidden_states + input_tensor): the branch's output stays a local of the output
  // module's forward until it returns, through the norm.
  T s1 = Add(g_, o, x);
  T a = LayerNorm(g_, s1, bp.norms[0].w, bp.norms[0].b, bp.norms[0].width);
  g_.Drop(s1);
  g_.Drop(o);
  if (!enc_.distil) g_.Drop(ctx);
  T up = LoraLinear(bp.at(TensorRole::kMlpUp), a);
  T act = Activation(up);
  g_.Drop(up);
  T down = LoraLinear(bp.at(TensorRole::kMlpDown), act);
  if (enc_.distil) g_.Drop(act);
  T dd = Dropout(g_, down, p);
  g_.Drop(down);
  // The attention's output (`attention_output`, BertLayer's local) too.
  T s2 = Add(g_, dd, a);
  T out = LayerNorm(g_, s2, bp.norms[1].w, bp.norms[1].b, bp.norms[1].width);
  g_.Drop(s2);
  g_.Drop(dd);
  g_.Drop(a);
  if (!enc_.distil) g_.Drop(act);
  return out;
}

T ModelRun::MaskedLmLoss(T hidden) {
  // BertLMPredictionHead: transform (dense, hidden_act, LayerNorm), then the decoder (the word
  // embedding, tied, with the head's bias). RobertaLMHead: dense, gelu, layer_norm, decoder.
  // DistilBertForMaskedLM: vocab_transform, activation, vocab_layer_norm, vocab_projector.
  // The loss: CrossEntropyLoss()(prediction_scores.view(-1, vocab_size), labels.view(-1)) on the
  // logits as they are (under autocast, in the autocast dtype: CrossEntropyLoss in step_ops.h).
  const Wide vocab = static_cast<Wide>(a_.vocab), h = static_cast<Wide>(a_.hidden);
  g_.SetWhere("mlm head");
  T t = LoraLinear(enc_.transform, hidden);
  T act = enc_.head_gelu ? Apply(g_, Unary::kGelu, t) : Activation(t);
  g_.Drop(t);
  const Norm& n = enc_.head_norm;
  T normed = LayerNorm(g_, act, n.w, n.b, n.width);
  g_.Drop(act);
  g_.SetWhere("mlm decoder");
  T logits = Linear(g_, normed, head_, head_bias_, h, vocab);
  g_.Drop(normed);
  g_.SetPhase(StepPhase::kLoss);
  g_.SetWhere("loss");
  T loss = CrossEntropyLoss(g_, logits, tokens_, vocab);
  // The training loop keeps `.loss` only.
  g_.Drop(logits);
  return loss;
}

T ModelRun::ClassifierLoss(T hidden) {
  // Note [Encoder classifiers in the step model].
  const Wide h = static_cast<Wide>(a_.hidden);
  const double p = a_.classifier_dropout;
  // Each takes `x` (the Python variable is rebound): dropout, and a dense layer's activation.
  auto dropout = [&](T x) {
    T d = Dropout(g_, x, p);
    g_.Drop(x);
    return d;
  };
  auto dense = [&](const Lin& l, Unary act, T x) {
    T d = LoraLinear(l, x);
    g_.Drop(x);
    T y = Apply(g_, act, d);
    g_.Drop(d);
    return y;
  };
  g_.SetWhere("classifier");
  T x;
  Wide rows = tokens_;
  if (enc_.task == Encoder::Task::kSequence) {
    rows = batch_;
    x = Slice(g_, hidden, batch_ * h);  // hidden_states[:, 0]
    if (enc_.pooler.ok()) {
      // BertPooler: tanh(dense(first token)); BertForSequenceClassification: dropout, classifier.
      x = dense(enc_.pooler, Unary::kTanh, x);
      g_.Drop(embedding_output_);  // BertModel.forward returns
      x = dropout(x);
    } else if (inv_.model_type == "distilbert") {
      // pre_classifier, nn.ReLU, dropout (seq_classif_dropout).
      x = dropout(dense(enc_.classifiers[0], Unary::kRelu, x));
    } else {
      // RobertaClassificationHead: dropout, dense, tanh, dropout.
      x = dropout(dense(enc_.classifiers[0], Unary::kTanh, dropout(x)));
    }
  } else {
    x = Dropout(g_, hidden, p);
  }
  const Lin& out = enc_.classifiers.back();
  T logits = LoraLinear(out, x);
  // RobertaClassificationHead's `x` is its own local, gone when the head returns. The others'
  // (pooled_output, sequence_output) are locals of the model's forward, which computes the loss.
  const bool head_local =
      enc_.task == Encoder::Task::kSequence && !enc_.pooler.ok() && inv_.model_type != "distilbert";
  if (head_local) g_.Drop(x);
  g_.SetPhase(StepPhase::kLoss);
  g_.SetWhere("loss");
  T loss = CrossEntropyLoss(g_, logits, rows, out.out);
  g_.Drop(logits);
  if (!head_local) g_.Drop(x);
  return loss;
}

Result<T> ModelRun::EncoderForward() {
  // BertModel.forward / DistilBertModel.forward: embeddings, the bidirectional mask (None here),
  // the layers (GradientCheckpointingLayer: each checkpointed per the setup), the head.
  explicit_mask_ = false;
  use_cache_ = false;
  g_.SetWhere("embedding");
  T x = EncoderEmbeddings();
  if (s_.checkpointing == Checkpointing::kFull) {
    // activation_checkpointing_enable -> enable_input_require_grads (a frozen embedding, LoRA).
    g_.SetRequiresGrad(x, true);
  }
  // BertModel.forward's embedding_output (DistilBertModel's embeddings) is a local until it
  // returns: through the layers, and BertPooler.
  embedding_output_ = g_.Alias(x);
  x = RunLayers(x);
  if (!enc_.pooler.ok()) g_.Drop(embedding_output_);
  T loss = enc_.task == Encoder::Task::kMaskedLm ? MaskedLmLoss(x) : ClassifierLoss(x);
  g_.Drop(x);
  g_.ClearAutocastCache();
  return loss;
}

}  // namespace memplan::estimator::step
