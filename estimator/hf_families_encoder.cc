// Family builders for the encoder families: bert, roberta, xlm-roberta, distilbert and t5
// (hf_config.h), with their task heads.
//
// Each builder emits the tensors of the class Transformers would build, in the order of
// `model.named_parameters(remove_duplicate=False)`: a module's own parameters before its
// children's, children in registration order; then the buffers (position_ids, token_type_ids:
// never parameters, but in Accelerate's sizes), and the modules Accelerate keeps whole
// (`_no_split_modules`).
//
// Where Transformers releases disagree, the checkpoint wins: an inventory should describe the
// tensors a user trains after `from_pretrained`. So
//   - BERT's `relative_key` position embeddings add `distance_embedding` (4.x; 5.x dropped the
//     option but checkpoints still carry the tensor);
//   - T5 v1.1 (`tie_word_embeddings: false`) keeps a separate lm_head (5.x's T5Config forces the
//     tie when building from a config, and unties again when a checkpoint's lm_head differs;
//     BuildOptions::from_config asks for the model built from the config: tied).
// Where releases differ only in order, the current one (5.x) wins: RoBERTa registers
// position_embeddings after LayerNorm there (4.x: second), and XLM-RoBERTa's head classes
// register their head before the encoder (so the head's decoder holds the tied embedding first).
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "estimator/hf_config.h"
#include "estimator/hf_family.h"

namespace memplan::estimator {
namespace {

// No real BERT or T5 stack comes near this; the cap keeps a hostile `num_layers: 2147483647` from
// building billions of tensor records (the input must never hang or exhaust memory).
constexpr int64_t kMaxLayers = 10000;

// Appends tensors under one dtype, in the order they are added.
class TensorSink {
 public:
  TensorSink(ModelInventory* out, DType dtype) : out_(out), dtype_(dtype) {}

  // A tensor with its role (Note [Tensor roles] in inventory.h).
  Status Param(std::string name, std::vector<int64_t> shape, TensorTraits traits,
               std::string tied_to = "") {
    return out_->Add(std::move(name), std::move(shape), dtype_, std::move(tied_to), traits);
  }

  // nn.Embedding(rows, width) `prefix`.weight.
  Status Embedding(const std::string& prefix, int64_t rows, int64_t width, TensorRole role,
                   std::string tied_to = "") {
    return Param(prefix + ".weight", {rows, width}, {role, ModuleKind::kEmbedding, false},
                 std::move(tied_to));
  }

  // nn.Linear(in, out): weight [out, in], then bias [out].
  Status Linear(const std::string& prefix, int64_t in, int64_t out, bool bias, TensorRole role) {
    MEMPLAN_RETURN_IF_ERROR(
        Param(prefix + ".weight", {out, in}, {role, ModuleKind::kLinear, false}));
    if (bias) {
      MEMPLAN_RETURN_IF_ERROR(Param(prefix + ".bias", {out}, {role, ModuleKind::kLinear, true}));
    }
    return Status::Ok();
  }

  // nn.LayerNorm(dim): weight and bias; T5's RMS norm (bias false): weight only.
  Status LayerNorm(const std::string& prefix, int64_t dim, bool bias = true) {
    MEMPLAN_RETURN_IF_ERROR(
        Param(prefix + ".weight", {dim}, {TensorRole::kNorm, ModuleKind::kNorm, false}));
    if (!bias) return Status::Ok();
    return Param(prefix + ".bias", {dim}, {TensorRole::kNorm, ModuleKind::kNorm, true});
  }

  // The position ids (and BERT's token type ids) embeddings register: int64 [1, positions].
  Status IdBuffer(const std::string& name, int64_t positions) {
    return out_->AddBuffer(name, {1, positions}, DType::kI64);
  }

 private:
  ModelInventory* out_;
  DType dtype_;
};

// `layers` as read from `field` (already a valid dimension), or an error past kMaxLayers.
Result<int64_t> CheckLayerCount(const ConfigReader& config, std::string_view field,
                                int64_t layers) {
  if (layers > kMaxLayers) {
    return config.FieldError(field, std::to_string(layers) + " layers is absurdly many (limit " +
                                        std::to_string(kMaxLayers) + ")");
  }
  return layers;
}

// The task head a class adds to its encoder.
enum class EncoderHead {
  kNone,
  kMaskedLm,      // the MLM prediction head (BertForMaskedLM, RobertaForMaskedLM)
  kCausalLm,      // the same head used causally (BertLMHeadModel, RobertaForCausalLM)
  kPreTraining,   // MLM head + next-sentence classifier
  kNextSentence,  // next-sentence classifier alone
  kSequence,      // ...ForSequenceClassification
  kToken,         // ...ForTokenClassification
  kQuestionAnswering,
  kMultipleChoice,
};

// One class a family can build: its name, the kind of model it is, its head, and whether its
// encoder keeps the pooler.
struct ClassSpec {
  std::string name;
  std::string_view model_class;  // "base", "masked_lm", "causal_lm", "seq2seq_lm", ...
  EncoderHead head = EncoderHead::kNone;
  bool pooler = false;
};

std::string_view HeadModelClass(EncoderHead head) {
  switch (head) {
    case EncoderHead::kNone: return "base";
    case EncoderHead::kMaskedLm:
    case EncoderHead::kPreTraining: return "masked_lm";
    case EncoderHead::kCausalLm: return "causal_lm";
    case EncoderHead::kNextSentence:
    case EncoderHead::kSequence: return "sequence_classification";
    case EncoderHead::kToken: return "token_classification";
    case EncoderHead::kQuestionAnswering: return "question_answering";
    case EncoderHead::kMultipleChoice: return "multiple_choice";
  }
  return "base";
}

// Older class names Transformers dropped, and the class they stood for (config.json files on the
// Hub still carry them: t5-3b and t5-11b say T5WithLMHeadModel).
std::string_view CurrentClassName(std::string_view name) {
  if (name == "T5WithLMHeadModel") return "T5ForConditionalGeneration";
  return name;
}

// Finds the class to build: the family's base class for kBase, `default_class` when config.json
// names none, else the named class if the family supports it.
Result<ClassSpec> ChooseClass(const FamilyRequest& request, const std::vector<ClassSpec>& classes,
                              std::string_view default_class) {
  // classes[0] is the base class by convention.
  std::string_view wanted = request.choice == ModelClassChoice::kBase ? classes[0].name
                            : request.architecture.empty()            ? default_class
                                                                      : request.architecture;
  wanted = CurrentClassName(wanted);
  for (const ClassSpec& spec : classes) {
    if (spec.name == wanted) return spec;
  }
  std::string supported;
  for (const ClassSpec& spec : classes) {
    supported += (supported.empty() ? "" : ", ") + spec.name;
  }
  return request.config.FieldError(
      "architectures", "'" + std::string(wanted) +
                           "' is not a class memplan can build (supported: " + supported +
                           "); pass `model_class` base to estimate the base model (" +
                           classes[0].name + ") without its task head");
}

// --- BERT and RoBERTa -----------------------------------------------------------------------

// RoBERTa and XLM-RoBERTa share structure and names (`roberta.`); XLM-RoBERTa's classes only
// register their head first.
enum class BertFlavor { kBert, kRoberta, kXlmRoberta };

struct BertDims {
  int64_t vocab = 0;
  int64_t hidden = 0;
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t intermediate = 0;
  int64_t max_positions = 0;
  int64_t type_vocab = 0;
  bool distance_embedding = false;  // position_embedding_type relative_key(_query)
  bool cross_attention = false;     // is_decoder with add_cross_attention
  bool tie_word_embeddings = true;
  int64_t labels = 2;
  std::string hidden_act;
  double hidden_dropout = 0;
  double attention_dropout = 0;
};

// The five sizes are required: save_pretrained always writes them (they are not
// PretrainedConfig fields, so no diff drops them), and a file without them is hand-made or cut
// short; guessing BERT-base's sizes would give a confident, wrong estimate. The rest follow
// BertConfig / RobertaConfig defaults.
Result<BertDims> ReadBertDims(const ConfigReader& config) {
  BertDims d;
  MEMPLAN_ASSIGN_OR_RETURN(d.vocab, config.Dim("vocab_size"));
  MEMPLAN_ASSIGN_OR_RETURN(d.hidden, config.Dim("hidden_size"));
  MEMPLAN_ASSIGN_OR_RETURN(d.layers, config.Dim("num_hidden_layers"));
  MEMPLAN_ASSIGN_OR_RETURN(d.layers, CheckLayerCount(config, "num_hidden_layers", d.layers));
  MEMPLAN_ASSIGN_OR_RETURN(d.heads, config.Dim("num_attention_heads"));
  MEMPLAN_ASSIGN_OR_RETURN(d.intermediate, config.Dim("intermediate_size"));
  MEMPLAN_ASSIGN_OR_RETURN(d.max_positions, config.DimOr("max_position_embeddings", 512));
  // A zero-row embedding is legal in PyTorch, and some exports drop segment ids that way.
  MEMPLAN_ASSIGN_OR_RETURN(d.type_vocab, config.CountOr("type_vocab_size", 2));
  if (d.hidden % d.heads != 0) {
    // BertSelfAttention refuses this too: heads * (hidden / heads) would not equal hidden.
    return config.FieldError(
        "num_attention_heads",
        std::to_string(d.heads) + " does not divide hidden_size " + std::to_string(d.hidden));
  }
  MEMPLAN_ASSIGN_OR_RETURN(std::string position_type,
                           config.StringOr("position_embedding_type", "absolute"));
  d.distance_embedding = position_type == "relative_key" || position_type == "relative_key_query";
  MEMPLAN_ASSIGN_OR_RETURN(bool is_decoder, config.BoolOr("is_decoder", false));
  MEMPLAN_ASSIGN_OR_RETURN(d.cross_attention, config.BoolOr("add_cross_attention", false));
  if (d.cross_attention && !is_decoder) {
    return config.FieldError("add_cross_attention",
                             "is true but 'is_decoder' is not; Transformers builds cross-attention "
                             "only into a decoder");
  }
  MEMPLAN_ASSIGN_OR_RETURN(d.tie_word_embeddings, config.BoolOr("tie_word_embeddings", true));
  MEMPLAN_ASSIGN_OR_RETURN(d.labels, family::NumLabels(config));
  MEMPLAN_ASSIGN_OR_RETURN(d.hidden_act, config.StringOr("hidden_act", "gelu"));
  MEMPLAN_ASSIGN_OR_RETURN(d.hidden_dropout, config.ProbabilityOr("hidden_dropout_prob", 0.1));
  MEMPLAN_ASSIGN_OR_RETURN(d.attention_dropout,
                           config.ProbabilityOr("attention_probs_dropout_prob", 0.1));
  return d;
}

// BertAttention / RobertaAttention: self.{query,key,value}, then output.{dense,LayerNorm}.
Status AddBertAttention(TensorSink& sink, const std::string& prefix, const BertDims& d,
                        bool distance_embedding) {
  const std::pair<const char*, TensorRole> projections[] = {{"query", TensorRole::kAttentionQ},
                                                            {"key", TensorRole::kAttentionK},
                                                            {"value", TensorRole::kAttentionV}};
  for (const auto& [proj, role] : projections) {
    MEMPLAN_RETURN_IF_ERROR(sink.Linear(prefix + ".self." + proj, d.hidden, d.hidden, true, role));
  }
  if (distance_embedding) {
    MEMPLAN_RETURN_IF_ERROR(sink.Embedding(prefix + ".self.distance_embedding",
                                           2 * d.max_positions - 1, d.hidden / d.heads,
                                           TensorRole::kPositionEmbedding));
  }
  MEMPLAN_RETURN_IF_ERROR(
      sink.Linear(prefix + ".output.dense", d.hidden, d.hidden, true, TensorRole::kAttentionOut));
  return sink.LayerNorm(prefix + ".output.LayerNorm", d.hidden);
}

// BertModel / RobertaModel under `prefix` ("" for the bare model, "bert." or "roberta." inside a
// head class). `word_embeddings_tied_to` names the head's decoder when the head came first.
Status AddBertModel(TensorSink& sink, const std::string& prefix, const BertDims& d,
                    BertFlavor flavor, bool pooler, const std::string& word_embeddings_tied_to,
                    ModelInventory* out) {
  const std::string emb = prefix + "embeddings.";
  MEMPLAN_RETURN_IF_ERROR(sink.Embedding(emb + "word_embeddings", d.vocab, d.hidden,
                                         TensorRole::kEmbedding, word_embeddings_tied_to));
  if (flavor == BertFlavor::kBert) {
    MEMPLAN_RETURN_IF_ERROR(sink.Embedding(emb + "position_embeddings", d.max_positions, d.hidden,
                                           TensorRole::kPositionEmbedding));
  }
  MEMPLAN_RETURN_IF_ERROR(sink.Embedding(emb + "token_type_embeddings", d.type_vocab, d.hidden,
                                         TensorRole::kTokenTypeEmbedding));
  MEMPLAN_RETURN_IF_ERROR(sink.LayerNorm(emb + "LayerNorm", d.hidden));
  if (flavor != BertFlavor::kBert) {
    // RobertaEmbeddings registers its padding-aware position table last (see file comment).
    MEMPLAN_RETURN_IF_ERROR(sink.Embedding(emb + "position_embeddings", d.max_positions, d.hidden,
                                           TensorRole::kPositionEmbedding));
  }
  for (int64_t i = 0; i < d.layers; ++i) {
    const std::string layer = prefix + "encoder.layer." + std::to_string(i);
    MEMPLAN_RETURN_IF_ERROR(AddBertAttention(sink, layer + ".attention", d, d.distance_embedding));
    if (d.cross_attention) {
      // Cross-attention always uses absolute positions, so never a distance table.
      MEMPLAN_RETURN_IF_ERROR(AddBertAttention(sink, layer + ".crossattention", d, false));
    }
    MEMPLAN_RETURN_IF_ERROR(sink.Linear(layer + ".intermediate.dense", d.hidden, d.intermediate,
                                        true, TensorRole::kMlpUp));
    MEMPLAN_RETURN_IF_ERROR(
        sink.Linear(layer + ".output.dense", d.intermediate, d.hidden, true, TensorRole::kMlpDown));
    MEMPLAN_RETURN_IF_ERROR(sink.LayerNorm(layer + ".output.LayerNorm", d.hidden));
  }
  if (pooler) {
    MEMPLAN_RETURN_IF_ERROR(
        sink.Linear(prefix + "pooler.dense", d.hidden, d.hidden, true, TensorRole::kPooler));
  }
  MEMPLAN_RETURN_IF_ERROR(sink.IdBuffer(emb + "position_ids", d.max_positions));
  MEMPLAN_RETURN_IF_ERROR(sink.IdBuffer(emb + "token_type_ids", d.max_positions));
  // _no_split_modules: the embeddings and every layer.
  out->no_split_modules.push_back(prefix + "embeddings");
  for (int64_t i = 0; i < d.layers; ++i) {
    out->no_split_modules.push_back(prefix + "encoder.layer." + std::to_string(i));
  }
  return Status::Ok();
}

// The masked-LM prediction head shared by BERT's cls.predictions and RoBERTa's lm_head. The head
// owns a `bias` parameter registered on the head module itself, so named_parameters lists it
// first; the decoder's bias is that same Parameter, and the decoder's weight is the word
// embedding unless tie_word_embeddings is false.
Status AddLmHead(TensorSink& sink, const std::string& head, const std::string& word_embeddings,
                 const BertDims& d, BertFlavor flavor) {
  // Registered before the encoder (XLM-RoBERTa), the head's decoder holds the tied matrix and the
  // word embedding becomes its alias; `word_embeddings` is then empty.
  MEMPLAN_RETURN_IF_ERROR(
      sink.Param(head + ".bias", {d.vocab}, {TensorRole::kHead, ModuleKind::kOther, true}));
  if (flavor == BertFlavor::kBert) {
    MEMPLAN_RETURN_IF_ERROR(sink.Linear(head + ".transform.dense", d.hidden, d.hidden, true,
                                        TensorRole::kHeadTransform));
    MEMPLAN_RETURN_IF_ERROR(sink.LayerNorm(head + ".transform.LayerNorm", d.hidden));
  } else {
    MEMPLAN_RETURN_IF_ERROR(
        sink.Linear(head + ".dense", d.hidden, d.hidden, true, TensorRole::kHeadTransform));
    MEMPLAN_RETURN_IF_ERROR(sink.LayerNorm(head + ".layer_norm", d.hidden));
  }
  MEMPLAN_RETURN_IF_ERROR(sink.Param(head + ".decoder.weight", {d.vocab, d.hidden},
                                     {TensorRole::kHead, ModuleKind::kLinear, false},
                                     d.tie_word_embeddings ? word_embeddings : ""));
  return sink.Param(head + ".decoder.bias", {d.vocab},
                    {TensorRole::kHead, ModuleKind::kLinear, true}, head + ".bias");
}

// The classes of a BERT-like family, base first. The LM classes and the token and QA heads build
// their encoder without the pooler; sequence classification keeps it for BERT only (RoBERTa's
// classification head pools by itself).
std::vector<ClassSpec> BertClasses(BertFlavor flavor) {
  const std::string p = flavor == BertFlavor::kBert      ? "Bert"
                        : flavor == BertFlavor::kRoberta ? "Roberta"
                                                         : "XLMRoberta";
  const bool bert = flavor == BertFlavor::kBert;
  std::vector<ClassSpec> classes = {
      {p + "Model", "base", EncoderHead::kNone, true},
      {p + "ForMaskedLM", "masked_lm", EncoderHead::kMaskedLm, false},
      {bert ? p + "LMHeadModel" : p + "ForCausalLM", "causal_lm", EncoderHead::kCausalLm, false},
      {p + "ForSequenceClassification", "", EncoderHead::kSequence, bert},
      {p + "ForTokenClassification", "", EncoderHead::kToken, false},
      {p + "ForQuestionAnswering", "", EncoderHead::kQuestionAnswering, false},
      {p + "ForMultipleChoice", "", EncoderHead::kMultipleChoice, true},
  };
  if (bert) {
    classes.push_back({"BertForPreTraining", "masked_lm", EncoderHead::kPreTraining, true});
    classes.push_back({"BertForNextSentencePrediction", "", EncoderHead::kNextSentence, true});
  }
  return classes;
}

// The head of `spec` for a BERT-like model whose encoder sits under `prefix`.
Status AddBertHead(TensorSink& sink, const ClassSpec& spec, const std::string& prefix,
                   const BertDims& d, BertFlavor flavor) {
  constexpr TensorRole kC = TensorRole::kClassifier;
  const bool bert = flavor == BertFlavor::kBert;
  const bool head_first = flavor == BertFlavor::kXlmRoberta;
  const std::string word_embeddings =
      head_first ? "" : prefix + "embeddings.word_embeddings.weight";
  switch (spec.head) {
    case EncoderHead::kNone: return Status::Ok();
    case EncoderHead::kMaskedLm:
    case EncoderHead::kCausalLm:
      return AddLmHead(sink, bert ? "cls.predictions" : "lm_head", word_embeddings, d, flavor);
    case EncoderHead::kPreTraining:
      MEMPLAN_RETURN_IF_ERROR(AddLmHead(sink, "cls.predictions", word_embeddings, d, flavor));
      return sink.Linear("cls.seq_relationship", d.hidden, 2, true, kC);
    case EncoderHead::kNextSentence:
      return sink.Linear("cls.seq_relationship", d.hidden, 2, true, kC);
    case EncoderHead::kSequence:
      if (bert) return sink.Linear("classifier", d.hidden, d.labels, true, kC);
      MEMPLAN_RETURN_IF_ERROR(sink.Linear("classifier.dense", d.hidden, d.hidden, true, kC));
      return sink.Linear("classifier.out_proj", d.hidden, d.labels, true, kC);
    case EncoderHead::kToken: return sink.Linear("classifier", d.hidden, d.labels, true, kC);
    case EncoderHead::kQuestionAnswering:
      return sink.Linear("qa_outputs", d.hidden, d.labels, true, kC);
    case EncoderHead::kMultipleChoice: return sink.Linear("classifier", d.hidden, 1, true, kC);
  }
  return Status::Ok();
}

Status BuildBertFamily(const FamilyRequest& request, ModelInventory* out, BertFlavor flavor) {
  const bool bert = flavor == BertFlavor::kBert;
  const std::vector<ClassSpec> classes = BertClasses(flavor);
  MEMPLAN_ASSIGN_OR_RETURN(ClassSpec spec, ChooseClass(request, classes, classes[1].name));
  MEMPLAN_ASSIGN_OR_RETURN(BertDims dims, ReadBertDims(request.config));
  MEMPLAN_ASSIGN_OR_RETURN(DType dtype, ConfigDType(request.config));
  TensorSink sink(out, dtype);

  const bool base = spec.head == EncoderHead::kNone;
  const std::string prefix = base ? "" : bert ? "bert." : "roberta.";
  const bool lm_head = spec.head == EncoderHead::kMaskedLm || spec.head == EncoderHead::kCausalLm ||
                       spec.head == EncoderHead::kPreTraining;
  if (flavor == BertFlavor::kXlmRoberta && !base) {
    MEMPLAN_RETURN_IF_ERROR(AddBertHead(sink, spec, prefix, dims, flavor));
    const std::string tied = lm_head && dims.tie_word_embeddings ? "lm_head.decoder.weight" : "";
    MEMPLAN_RETURN_IF_ERROR(AddBertModel(sink, prefix, dims, flavor, spec.pooler, tied, out));
  } else {
    MEMPLAN_RETURN_IF_ERROR(AddBertModel(sink, prefix, dims, flavor, spec.pooler, "", out));
    MEMPLAN_RETURN_IF_ERROR(AddBertHead(sink, spec, prefix, dims, flavor));
  }
  out->architecture = spec.name;
  out->model_class = std::string(HeadModelClass(spec.head));
  ArchitectureInfo arch;
  arch.hidden = dims.hidden;
  arch.layers = dims.layers;
  arch.heads = arch.kv_heads = dims.heads;
  arch.head_dim = dims.hidden / dims.heads;
  arch.intermediate = dims.intermediate;
  arch.vocab = dims.vocab;
  // RoBERTa's position ids start after the padding index (1), so two rows are never used.
  arch.max_positions = bert ? dims.max_positions : std::max<int64_t>(dims.max_positions - 2, 1);
  arch.learned_positions = true;
  arch.hidden_act = dims.hidden_act;
  arch.hidden_dropout = dims.hidden_dropout;
  arch.attention_dropout = dims.attention_dropout;
  arch.embedding_dropout = dims.hidden_dropout;
  arch.classifier_dropout = dims.hidden_dropout;
  if (request.config.Has("classifier_dropout")) {
    MEMPLAN_ASSIGN_OR_RETURN(arch.classifier_dropout,
                             request.config.ProbabilityOr("classifier_dropout", 0.1));
  }
  arch.no_split_class = bert                             ? "BertLayer"
                        : flavor == BertFlavor::kRoberta ? "RobertaLayer"
                                                         : "XLMRobertaLayer";
  out->arch = arch;
  return Status::Ok();
}

// --- DistilBERT -------------------------------------------------------------------------------

// DistilBertConfig names its sizes dim, n_layers, n_heads and hidden_dim (hidden_size etc. through
// its attribute_map, which then win); required as for BERT.
Status BuildDistilBertImpl(const FamilyRequest& request, ModelInventory* out) {
  const ConfigReader& config = request.config;
  const std::vector<ClassSpec> classes = {
      {"DistilBertModel", "base", EncoderHead::kNone, false},
      {"DistilBertForMaskedLM", "masked_lm", EncoderHead::kMaskedLm, false},
      {"DistilBertForSequenceClassification", "", EncoderHead::kSequence, false},
      {"DistilBertForTokenClassification", "", EncoderHead::kToken, false},
      {"DistilBertForQuestionAnswering", "", EncoderHead::kQuestionAnswering, false},
      {"DistilBertForMultipleChoice", "", EncoderHead::kMultipleChoice, false},
  };
  MEMPLAN_ASSIGN_OR_RETURN(ClassSpec spec, ChooseClass(request, classes, classes[1].name));
  auto dim = [&](std::string_view field, std::string_view alias) -> Result<int64_t> {
    return config.Dim(config.Has(alias) ? alias : field);
  };
  MEMPLAN_ASSIGN_OR_RETURN(int64_t vocab, config.Dim("vocab_size"));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t hidden, dim("dim", "hidden_size"));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t layers, dim("n_layers", "num_hidden_layers"));
  MEMPLAN_ASSIGN_OR_RETURN(layers, CheckLayerCount(config, "n_layers", layers));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t heads, dim("n_heads", "num_attention_heads"));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t ffn, config.Dim("hidden_dim"));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t positions, config.DimOr("max_position_embeddings", 512));
  MEMPLAN_ASSIGN_OR_RETURN(bool tie, config.BoolOr("tie_word_embeddings", true));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t labels, family::NumLabels(config));
  if (spec.head == EncoderHead::kQuestionAnswering && labels != 2) {
    // DistilBertForQuestionAnswering refuses any other count: it predicts start and end.
    return config.FieldError(config.Has("id2label") ? "id2label" : "num_labels",
                             "DistilBertForQuestionAnswering needs 2 labels (start, end), got " +
                                 std::to_string(labels));
  }
  if (hidden % heads != 0) {
    return config.FieldError(
        config.Has("num_attention_heads") ? "num_attention_heads" : "n_heads",
        std::to_string(heads) + " does not divide dim " + std::to_string(hidden));
  }
  MEMPLAN_ASSIGN_OR_RETURN(DType dtype, ConfigDType(config));
  TensorSink sink(out, dtype);
  const bool base = spec.head == EncoderHead::kNone;
  const std::string prefix = base ? "" : "distilbert.";
  const std::string emb = prefix + "embeddings.";
  MEMPLAN_RETURN_IF_ERROR(
      sink.Embedding(emb + "word_embeddings", vocab, hidden, TensorRole::kEmbedding));
  MEMPLAN_RETURN_IF_ERROR(sink.Embedding(emb + "position_embeddings", positions, hidden,
                                         TensorRole::kPositionEmbedding));
  MEMPLAN_RETURN_IF_ERROR(sink.LayerNorm(emb + "LayerNorm", hidden));
  for (int64_t i = 0; i < layers; ++i) {
    const std::string layer = prefix + "transformer.layer." + std::to_string(i) + ".";
    const std::pair<const char*, TensorRole> projections[] = {
        {"q_lin", TensorRole::kAttentionQ},
        {"k_lin", TensorRole::kAttentionK},
        {"v_lin", TensorRole::kAttentionV},
        {"out_lin", TensorRole::kAttentionOut}};
    for (const auto& [proj, role] : projections) {
      MEMPLAN_RETURN_IF_ERROR(sink.Linear(layer + "attention." + proj, hidden, hidden, true, role));
    }
    MEMPLAN_RETURN_IF_ERROR(sink.LayerNorm(layer + "sa_layer_norm", hidden));
    MEMPLAN_RETURN_IF_ERROR(sink.Linear(layer + "ffn.lin1", hidden, ffn, true, TensorRole::kMlpUp));
    MEMPLAN_RETURN_IF_ERROR(
        sink.Linear(layer + "ffn.lin2", ffn, hidden, true, TensorRole::kMlpDown));
    MEMPLAN_RETURN_IF_ERROR(sink.LayerNorm(layer + "output_layer_norm", hidden));
  }
  MEMPLAN_RETURN_IF_ERROR(sink.IdBuffer(emb + "position_ids", positions));
  switch (spec.head) {
    case EncoderHead::kMaskedLm:
      MEMPLAN_RETURN_IF_ERROR(
          sink.Linear("vocab_transform", hidden, hidden, true, TensorRole::kHeadTransform));
      MEMPLAN_RETURN_IF_ERROR(sink.LayerNorm("vocab_layer_norm", hidden));
      MEMPLAN_RETURN_IF_ERROR(sink.Param("vocab_projector.weight", {vocab, hidden},
                                         {TensorRole::kHead, ModuleKind::kLinear, false},
                                         tie ? emb + "word_embeddings.weight" : ""));
      MEMPLAN_RETURN_IF_ERROR(sink.Param("vocab_projector.bias", {vocab},
                                         {TensorRole::kHead, ModuleKind::kLinear, true}));
      break;
    case EncoderHead::kSequence:
    case EncoderHead::kMultipleChoice:
      MEMPLAN_RETURN_IF_ERROR(
          sink.Linear("pre_classifier", hidden, hidden, true, TensorRole::kClassifier));
      MEMPLAN_RETURN_IF_ERROR(sink.Linear("classifier", hidden,
                                          spec.head == EncoderHead::kSequence ? labels : 1, true,
                                          TensorRole::kClassifier));
      break;
    case EncoderHead::kToken:
      MEMPLAN_RETURN_IF_ERROR(
          sink.Linear("classifier", hidden, labels, true, TensorRole::kClassifier));
      break;
    case EncoderHead::kQuestionAnswering:
      MEMPLAN_RETURN_IF_ERROR(
          sink.Linear("qa_outputs", hidden, labels, true, TensorRole::kClassifier));
      break;
    default: break;
  }
  out->architecture = spec.name;
  out->model_class = std::string(HeadModelClass(spec.head));
  ArchitectureInfo arch;
  arch.hidden = hidden;
  arch.layers = layers;
  arch.heads = arch.kv_heads = heads;
  arch.head_dim = hidden / heads;
  arch.intermediate = ffn;
  arch.vocab = vocab;
  arch.max_positions = positions;
  arch.learned_positions = true;
  MEMPLAN_ASSIGN_OR_RETURN(arch.hidden_act, config.StringOr("activation", "gelu"));
  MEMPLAN_ASSIGN_OR_RETURN(arch.hidden_dropout, config.ProbabilityOr("dropout", 0.1));
  MEMPLAN_ASSIGN_OR_RETURN(arch.attention_dropout, config.ProbabilityOr("attention_dropout", 0.1));
  arch.embedding_dropout = arch.hidden_dropout;
  arch.classifier_dropout = arch.hidden_dropout;
  if (spec.head == EncoderHead::kSequence) {
    MEMPLAN_ASSIGN_OR_RETURN(arch.classifier_dropout,
                             config.ProbabilityOr("seq_classif_dropout", 0.2));
  }
  arch.no_split_class = "TransformerBlock";
  out->arch = arch;
  return Status::Ok();
}

// --- T5 ---------------------------------------------------------------------------------------

struct T5Dims {
  int64_t vocab = 0;
  int64_t model = 0;  // d_model
  int64_t kv = 0;     // d_kv, per head
  int64_t ff = 0;     // d_ff
  int64_t encoder_layers = 0;
  int64_t decoder_layers = 0;
  int64_t heads = 0;
  int64_t buckets = 0;
  bool gated = false;
  bool tie_word_embeddings = true;
  bool use_cache = true;
  std::string act;     // "relu", "gelu", ... without the "gated-" prefix
  double dropout = 0;  // dropout_rate: everywhere T5 drops out
};

// Required sizes as for BERT (see ReadBertDims); the rest follow T5Config's defaults.
Result<T5Dims> ReadT5Dims(const ConfigReader& config) {
  T5Dims d;
  MEMPLAN_ASSIGN_OR_RETURN(d.vocab, config.Dim("vocab_size"));
  MEMPLAN_ASSIGN_OR_RETURN(d.model, config.Dim("d_model"));
  MEMPLAN_ASSIGN_OR_RETURN(d.kv, config.DimOr("d_kv", 64));
  MEMPLAN_ASSIGN_OR_RETURN(d.ff, config.Dim("d_ff"));
  MEMPLAN_ASSIGN_OR_RETURN(d.encoder_layers, config.Dim("num_layers"));
  MEMPLAN_ASSIGN_OR_RETURN(d.encoder_layers,
                           CheckLayerCount(config, "num_layers", d.encoder_layers));
  MEMPLAN_ASSIGN_OR_RETURN(d.decoder_layers, config.DimOr("num_decoder_layers", d.encoder_layers));
  MEMPLAN_ASSIGN_OR_RETURN(d.decoder_layers,
                           CheckLayerCount(config, "num_decoder_layers", d.decoder_layers));
  MEMPLAN_ASSIGN_OR_RETURN(d.heads, config.Dim("num_heads"));
  MEMPLAN_ASSIGN_OR_RETURN(d.buckets, config.DimOr("relative_attention_num_buckets", 32));
  // T5Config accepts "ACT" or "gated-ACT" and refuses anything else.
  MEMPLAN_ASSIGN_OR_RETURN(std::string proj, config.StringOr("feed_forward_proj", "relu"));
  std::string_view act = proj;
  d.gated = act.rfind("gated-", 0) == 0;
  if (d.gated) act.remove_prefix(6);
  if (act.empty() || act.find('-') != std::string_view::npos) {
    return config.FieldError("feed_forward_proj",
                             "'" + proj +
                                 "' is not of the form 'ACT' or 'gated-ACT' (e.g. 'relu', "
                                 "'gated-gelu')");
  }
  MEMPLAN_ASSIGN_OR_RETURN(d.tie_word_embeddings, config.BoolOr("tie_word_embeddings", true));
  MEMPLAN_ASSIGN_OR_RETURN(d.use_cache, config.BoolOr("use_cache", true));
  d.act = std::string(act);
  MEMPLAN_ASSIGN_OR_RETURN(d.dropout, config.ProbabilityOr("dropout_rate", 0.1));
  return d;
}

// T5Attention: q, k, v, o without biases; block 0's self-attention also owns the relative
// position bias table that the later blocks reuse.
Status AddT5Attention(TensorSink& sink, const std::string& prefix, const T5Dims& d,
                      bool relative_bias) {
  const int64_t inner = d.heads * d.kv;
  const std::pair<const char*, TensorRole> projections[] = {{"q", TensorRole::kAttentionQ},
                                                            {"k", TensorRole::kAttentionK},
                                                            {"v", TensorRole::kAttentionV}};
  for (const auto& [proj, role] : projections) {
    MEMPLAN_RETURN_IF_ERROR(sink.Linear(prefix + "." + proj, d.model, inner, false, role));
  }
  MEMPLAN_RETURN_IF_ERROR(
      sink.Linear(prefix + ".o", inner, d.model, false, TensorRole::kAttentionOut));
  if (relative_bias) {
    MEMPLAN_RETURN_IF_ERROR(sink.Embedding(prefix + ".relative_attention_bias", d.buckets, d.heads,
                                           TensorRole::kRelativeAttentionBias));
  }
  return Status::Ok();
}

// T5Stack: embed_tokens (the shared embedding module itself), blocks, final_layer_norm. T5's
// layer norms are RMS norms: a weight and no bias.
// `shared` names the shared embedding; blocks are recorded as Accelerate's no-split modules.
Status AddT5Stack(TensorSink& sink, const std::string& stack, const std::string& shared,
                  const T5Dims& d, bool decoder, ModelInventory* out) {
  MEMPLAN_RETURN_IF_ERROR(
      sink.Embedding(stack + ".embed_tokens", d.vocab, d.model, TensorRole::kEmbedding, shared));
  const int64_t layers = decoder ? d.decoder_layers : d.encoder_layers;
  for (int64_t i = 0; i < layers; ++i) {
    // T5Block.layer: self-attention, cross-attention (decoder only), feed-forward.
    out->no_split_modules.push_back(stack + ".block." + std::to_string(i));
    const std::string block = stack + ".block." + std::to_string(i) + ".layer.";
    MEMPLAN_RETURN_IF_ERROR(AddT5Attention(sink, block + "0.SelfAttention", d, i == 0));
    MEMPLAN_RETURN_IF_ERROR(sink.LayerNorm(block + "0.layer_norm", d.model, false));
    if (decoder) {
      MEMPLAN_RETURN_IF_ERROR(AddT5Attention(sink, block + "1.EncDecAttention", d, false));
      MEMPLAN_RETURN_IF_ERROR(sink.LayerNorm(block + "1.layer_norm", d.model, false));
    }
    const std::string ff = block + (decoder ? "2" : "1");
    if (d.gated) {
      MEMPLAN_RETURN_IF_ERROR(
          sink.Linear(ff + ".DenseReluDense.wi_0", d.model, d.ff, false, TensorRole::kMlpGate));
      MEMPLAN_RETURN_IF_ERROR(
          sink.Linear(ff + ".DenseReluDense.wi_1", d.model, d.ff, false, TensorRole::kMlpUp));
    } else {
      MEMPLAN_RETURN_IF_ERROR(
          sink.Linear(ff + ".DenseReluDense.wi", d.model, d.ff, false, TensorRole::kMlpUp));
    }
    MEMPLAN_RETURN_IF_ERROR(
        sink.Linear(ff + ".DenseReluDense.wo", d.ff, d.model, false, TensorRole::kMlpDown));
    MEMPLAN_RETURN_IF_ERROR(sink.LayerNorm(ff + ".layer_norm", d.model, false));
  }
  return sink.LayerNorm(stack + ".final_layer_norm", d.model, false);
}

}  // namespace

Status BuildBert(const FamilyRequest& request, ModelInventory* out) {
  return BuildBertFamily(request, out, BertFlavor::kBert);
}

Status BuildRoberta(const FamilyRequest& request, ModelInventory* out) {
  return BuildBertFamily(request, out, BertFlavor::kRoberta);
}

Status BuildXlmRoberta(const FamilyRequest& request, ModelInventory* out) {
  return BuildBertFamily(request, out, BertFlavor::kXlmRoberta);
}

Status BuildDistilBert(const FamilyRequest& request, ModelInventory* out) {
  return BuildDistilBertImpl(request, out);
}

Status BuildT5(const FamilyRequest& request, ModelInventory* out) {
  // T5ForSequenceClassification wraps a T5Model and T5ForTokenClassification a T5EncoderModel
  // under `transformer`; T5ForQuestionAnswering holds the stacks itself.
  static const std::vector<ClassSpec> kClasses = {
      {"T5Model", "base"},
      {"T5ForConditionalGeneration", "seq2seq_lm"},
      {"T5EncoderModel", "base"},
      {"T5ForSequenceClassification", "sequence_classification", EncoderHead::kSequence},
      {"T5ForTokenClassification", "token_classification", EncoderHead::kToken},
      {"T5ForQuestionAnswering", "question_answering", EncoderHead::kQuestionAnswering}};
  MEMPLAN_ASSIGN_OR_RETURN(ClassSpec spec,
                           ChooseClass(request, kClasses, "T5ForConditionalGeneration"));
  MEMPLAN_ASSIGN_OR_RETURN(T5Dims dims, ReadT5Dims(request.config));
  MEMPLAN_ASSIGN_OR_RETURN(DType dtype, ConfigDType(request.config));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t labels, family::NumLabels(request.config));
  TensorSink sink(out, dtype);

  const bool encoder_only = spec.name == "T5EncoderModel" || spec.head == EncoderHead::kToken;
  const std::string prefix =
      spec.head == EncoderHead::kSequence || spec.head == EncoderHead::kToken ? "transformer." : "";
  // Both stacks hold the shared embedding module itself, so embed_tokens is tied whatever
  // tie_word_embeddings says; that flag only decides whether lm_head is a separate matrix.
  const std::string shared = prefix + "shared.weight";
  MEMPLAN_RETURN_IF_ERROR(sink.Param(shared, {dims.vocab, dims.model},
                                     {TensorRole::kEmbedding, ModuleKind::kEmbedding, false}));
  MEMPLAN_RETURN_IF_ERROR(AddT5Stack(sink, prefix + "encoder", shared, dims, false, out));
  if (!encoder_only) {
    MEMPLAN_RETURN_IF_ERROR(AddT5Stack(sink, prefix + "decoder", shared, dims, true, out));
  }
  switch (spec.head) {
    case EncoderHead::kSequence:
      MEMPLAN_RETURN_IF_ERROR(sink.Linear("classification_head.dense", dims.model, dims.model, true,
                                          TensorRole::kClassifier));
      MEMPLAN_RETURN_IF_ERROR(sink.Linear("classification_head.out_proj", dims.model, labels, true,
                                          TensorRole::kClassifier));
      break;
    case EncoderHead::kToken:
      MEMPLAN_RETURN_IF_ERROR(
          sink.Linear("classifier", dims.model, labels, true, TensorRole::kClassifier));
      break;
    case EncoderHead::kQuestionAnswering:
      MEMPLAN_RETURN_IF_ERROR(
          sink.Linear("qa_outputs", dims.model, labels, true, TensorRole::kClassifier));
      break;
    default: break;
  }
  if (spec.model_class == "seq2seq_lm") {
    MEMPLAN_RETURN_IF_ERROR(sink.Param(
        "lm_head.weight", {dims.vocab, dims.model}, {TensorRole::kHead, ModuleKind::kLinear, false},
        dims.tie_word_embeddings || request.from_config ? "shared.weight" : ""));
  }
  out->architecture = std::string(spec.name);
  out->model_class = std::string(spec.model_class);
  ArchitectureInfo arch;
  arch.hidden = dims.model;
  arch.layers = dims.encoder_layers;
  arch.encoder_decoder = !encoder_only;
  arch.decoder_layers = arch.encoder_decoder ? dims.decoder_layers : 0;
  arch.heads = arch.kv_heads = dims.heads;
  arch.head_dim = dims.kv;
  arch.intermediate = dims.ff;
  arch.vocab = dims.vocab;
  arch.hidden_act = dims.act;
  arch.gated_mlp = dims.gated;
  arch.hidden_dropout = arch.attention_dropout = arch.embedding_dropout = dims.dropout;
  arch.no_split_class = "T5Block";
  arch.norm_upcasts = true;  // T5LayerNorm computes its variance in fp32
  arch.use_cache = dims.use_cache;
  arch.scale_decoder_output = dims.tie_word_embeddings;
  out->arch = arch;
  return Status::Ok();
}

}  // namespace memplan::estimator
