// `--calibration FILE` of `plan` and `capacity`: the step-time constants `memplan calibrate`
// fitted, read once (tools/calibrate_command.cc).
#pragma once

#include <string>

#include "common/status.h"
#include "planner/calibrate.h"

namespace memplan::tools {

// Reads a calibration file (planner::CalibrationFromJson). Errors name the file and the key.
Result<planner::Calibration> ReadCalibrationFile(const std::string& path);

// Note [Calibration bounds]'s warnings of a calibration file, as `plan` and `capacity` repeat them
// above their report: "warning: --calibration PATH: ...", one line each ("" when none).
std::string CalibrationWarningLines(const planner::Calibration& calibration,
                                    const std::string& path);

}  // namespace memplan::tools
