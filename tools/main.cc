// memplan: plan memory for training large models. See README.md for the tour; the command line is
// tools/cli.cc.
#include "tools/cli.h"

int main(int argc, char** argv) { return memplan::tools::Main(argc, argv); }
