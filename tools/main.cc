// memplan: plan memory for training large models. See README.md for the tour.
#include <cstdio>
#include <string>

#include "tools/commands.h"

int main(int argc, char** argv) {
  using memplan::tools::Outcome;
  CLI::App app{
      "memplan: will a training job fit, where should each byte live, and how fast will it run?\n"
      "Estimates GPU/CPU memory per ZeRO stage and offload choice from a Hugging Face "
      "config.json, a tensor-shape list or safetensors headers, without loading weights, and "
      "measures the NVMe bandwidth and CPU optimizer speed an offload plan can count on."};
  app.name("memplan");
  app.set_version_flag("--version", std::string("memplan ") + MEMPLAN_VERSION);
  app.require_subcommand(1);
  app.footer("\nRun `memplan <command> --help` for a command's options.");
  Outcome outcome;
  memplan::tools::RegisterEstimate(app, &outcome);
  memplan::tools::RegisterInventory(app, &outcome);
  memplan::tools::RegisterModels(app, &outcome);
  memplan::tools::RegisterBench(app, &outcome);
  memplan::tools::RegisterPlan(app, &outcome);
  memplan::tools::RegisterCheck(app, &outcome);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    while (!what.empty() && what.back() == '\n') what.pop_back();
    std::fprintf(stderr, "memplan: error: %s (see --help)\n", what.c_str());
    return memplan::tools::kExitBadInput;
  }
  if (!outcome.error.empty()) {
    std::fprintf(stderr, "memplan: error: %s\n", outcome.error.c_str());
    return outcome.exit_code;
  }
  std::fwrite(outcome.stdout_text.data(), 1, outcome.stdout_text.size(), stdout);
  if (std::fflush(stdout) != 0) {
    std::fprintf(stderr, "memplan: error: cannot write to stdout\n");
    return memplan::tools::kExitInternal;
  }
  return outcome.exit_code;
}
