// What each fuzz target does with one input, shared by the libFuzzer entry points
// (fuzz/<name>_fuzz.cc, built with -DMEMPLAN_FUZZ=ON and clang) and by the regression test
// (tests/fuzz_regressions_test.cc), which replays every checked-in seed and every input that once
// crashed a target through the same code in the ordinary test suite, with any compiler.
//
// Each function feeds `input` to one parser of untrusted bytes and then to what memplan does with
// the result (count, estimate, format). A parser error is the expected outcome for most inputs and
// is not reported; the returned Status is an error only when a property that must hold for every
// input is broken (e.g. a decoded swap index that does not encode back to the same bytes). A
// crash, a sanitizer report, a hang or an outsized allocation is a bug the fuzzer reports itself.
#pragma once

#include <string_view>

#include "common/status.h"

namespace memplan::fuzz {

// A .json model file as `memplan estimate --model FILE.json` reads it (LoadModel): a Hugging Face
// config.json, or a shape list when it looks like one.
Status HfConfigOne(std::string_view input);
// A tensor-shape list, as `memplan estimate --model shapes.json` reads it.
Status ShapeListOne(std::string_view input);
// A whole .safetensors file (length prefix, JSON header, data).
Status SafetensorsOne(std::string_view input);
// A DeepSpeed config, as `memplan estimate --deepspeed ds_config.json` reads it.
Status DeepSpeedConfigOne(std::string_view input);
// A DeepSpeed config, as `memplan check ds_config.json` checks it (planner::CheckDeepSpeedConfig).
Status DeepSpeedCheckOne(std::string_view input);
// An Accelerate config file as `memplan check accelerate.yaml` reads it: YAML with PyYAML's
// scalars (tools::ParseYamlAsJson), then planner::CheckAccelerateConfig alone and with a model
// and a cluster. Broken when the reader accepts a document that is not JSON-serialisable back to
// an equal value (every value it returns must survive dump and parse).
Status AccelerateCheckOne(std::string_view input);
// A SwapStore index file, decoded as it is and again with its trailer checksum made valid.
Status SwapIndexOne(std::string_view input);
// A memplan command line, one argument per line of `input`, after the subcommand its first byte
// picks (estimate, inventory, plan, check; never `bench`, which writes files), run through
// tools::RunCli (which writes nothing) with the Hub offline. Broken when the exit status is not
// 0, 1 or 2, when an error has no message or a success has one, or when an error spans lines.
Status CliOne(std::string_view input);
// `memplan check`'s batch arithmetic: train_batch_size, micro-batch, accumulation (each present
// or not) and the world size, taken from the input's bytes over the whole int64 range, checked
// against the same rule computed in 128 bits. Broken when check's verdict on train_batch_size
// differs from DeepSpeed's rule.
Status CheckArithmeticOne(std::string_view input);
// A launch script (planner::LaunchScript) from hostile strings in every field: the first byte picks
// the launcher, the nodes and the options, the rest is split at 0x1f into the plan's description,
// the GPU name, the training script, its arguments, the config paths, the hostfile, the job name,
// the sbatch partition and time. Broken when a refusal does not name its field, or when the
// script is not exactly its fixed lines, one-line comments and one launch line that a shell-word
// reader (the subset of bash memplan writes: plain words, single quotes, '\'' and double-quoted
// variables) splits into the launcher and exactly the arguments given (Note [Generated text]).
Status LaunchScriptOne(std::string_view input);

}  // namespace memplan::fuzz
