// The training-setup knobs that `memplan estimate`, `plan` and `check` all accept, spelled and
// defaulted once (the defaults are TrainingSetup's): memory-efficient attention, the optimizer
// step's implementation, SGD momentum, sequence parallelism, torch.autocast, DDP's
// gradient_as_bucket_view, the training code (--framework) and the PyTorch release.
#pragma once

#include <string>
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

}  // namespace memplan::tools
