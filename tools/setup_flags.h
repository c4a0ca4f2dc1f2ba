// The training-setup knobs that `memplan estimate`, `plan` and `check` all accept, spelled and
// defaulted once (the defaults are TrainingSetup's): memory-efficient attention, the optimizer
// step's implementation, SGD momentum, sequence parallelism, torch.autocast, DDP's
// gradient_as_bucket_view, the training code (--framework) and the PyTorch release.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "estimator/training_setup.h"
#include "planner/plan_request.h"

namespace memplan::tools {

struct SharedSetupFlags {
  estimator::TrainingSetup values;         // only the fields below are read
  std::string framework = "transformers";  // parsed into values.framework by Apply
  std::string loss = "full";               // parsed into values.loss by Apply
  // Each registered option with the TrainingSetup field it sets.
  std::vector<std::pair<CLI::Option*, std::string>> options;

  // Registers the flags on `cmd` in option group `group`.
  void Add(CLI::App* cmd, const std::string& group);
  // Copies the flags into `setup`: all of them, or with `only_given` those on the command line.
  void Apply(estimator::TrainingSetup* setup, bool only_given) const;
};

// The job flags `memplan plan` and `memplan capacity` both take after --global-batch and
// --global-batch-tokens (which each parses its own way): --seq-len, --precision, --optimizer, the
// LoRA flags, the SharedSetupFlags and --cuda-context-mib, in that order in the help.
struct JobSetupFlags {
  int64_t seq_len = 0;
  std::string precision;  // empty: the default (planner::DefaultPrecision)
  std::string optimizer = "adamw";
  int64_t lora_rank = 0;
  std::vector<std::string> lora_targets;
  bool qlora = false;
  SharedSetupFlags shared;  // --flash-attention/--no-flash-attention, --foreach, ...
  double cuda_context_mib = 1343;
  CLI::Option* optimizer_option = nullptr;  // set by Add

  // Registers the flags on `cmd` in option group `group`. The help of --precision and --optimizer
  // is each command's own: it says that command's defaults.
  void Add(CLI::App* cmd, const std::string& group, const std::string& precision_help,
           const std::string& optimizer_help);
  // --optimizer was on the command line: the search tries no 8-bit variant of it.
  bool OptimizerGiven() const {
    return optimizer_option != nullptr && optimizer_option->count() > 0;
  }
  // Puts the flags into a plan request: the setup, and --precision and --optimizer only when
  // given (planner::Resolve applies their defaults, Note [Plan defaults]). Fails when either is
  // not a name the estimator knows.
  Status Fill(planner::PlanRequest* request) const;
};

// The library names a field in its messages as the JSON request, setup or cluster file spells it,
// in backquotes (Note [Field names in errors] in estimator/training_setup.h); people at the
// command line typed flags. FieldsToFlags returns `text` with each backquoted field that has a
// flag replaced by the flag ("`micro_batch` must be ..." -> "--micro-batch must be ..."); anything
// else, backquoted or not, is left as it is. For what the CLI prints for people (error lines, text
// output), not JSON.
//
// A field means the same thing to every command, with one flag, except where a command spells it
// its own way: `overrides` (field, flag) pairs come first (`memplan capacity` sets an offer's
// `gpus_per_node` with --gpus-per-node, where plan's --gpus is GPUs per node).
using FieldFlags = std::span<const std::pair<std::string_view, std::string_view>>;
std::string FieldsToFlags(std::string_view text, FieldFlags overrides = {});
// The flag for `field` (overrides first), or empty when no flag sets it.
std::string_view FlagForField(std::string_view field, FieldFlags overrides = {});
// Every field the mapping knows, for tests.
std::vector<std::string_view> MappedFields();

}  // namespace memplan::tools
