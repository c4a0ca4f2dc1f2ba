// The training-setup knobs that `memplan estimate`, `plan` and `check` all accept, spelled and
// defaulted once (the defaults are TrainingSetup's): memory-efficient attention, the optimizer
// step's implementation, SGD momentum, sequence parallelism, torch.autocast, DDP's
// gradient_as_bucket_view, the training code (--framework) and the PyTorch release.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "estimator/training_setup.h"

namespace memplan::tools {

struct SharedSetupFlags {
  estimator::TrainingSetup values;  // only the fields below are read
  std::string framework = "transformers";  // parsed into values.framework by Apply
  // Each registered option with the TrainingSetup field it sets.
  std::vector<std::pair<CLI::Option*, std::string>> options;

  // Registers the flags on `cmd` in option group `group`.
  void Add(CLI::App* cmd, const std::string& group);
  // Copies the flags into `setup`: all of them, or with `only_given` those on the command line.
  void Apply(estimator::TrainingSetup* setup, bool only_given) const;
};

// The library names a training-setup field in its messages as the setup's JSON spells it, in
// backquotes (Note [Field names in errors] in estimator/training_setup.h); people at the command
// line typed flags. Returns `text` with each backquoted field that has a flag replaced by the flag
// ("`micro_batch` must be ..." -> "--micro-batch must be ..."); anything else, backquoted or not,
// is left as it is. For what the CLI prints for people (error lines, text output), not JSON.
std::string FieldsToFlags(std::string_view text);

}  // namespace memplan::tools
