// A fixture for planner_layering_detects (tests/CMakeLists.txt): a file the check must reject.
#include "offload/engine.h"
