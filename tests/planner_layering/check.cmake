# cmake -DDIR=<folder> -P check.cmake: fails, naming each file and line, when a C++ file in <folder>
# includes a header of the offload engine, the storage seam or the GPU seam (offload/, nvme/,
# gpu/). The planner reaches the engine only through the Schedule contract (Note [Schedule
# contract] in schedule/schedule.h); the top-level CMakeLists.txt checks its link graph, this its
# #includes, which a header-only use would slip past the link check.
if(NOT DIR)
  message(FATAL_ERROR "usage: cmake -DDIR=<folder> -P check.cmake")
endif()
file(GLOB files ${DIR}/*.cc ${DIR}/*.h)
if(NOT files)
  message(FATAL_ERROR "no .cc or .h files in ${DIR}")
endif()
set(offending "")
foreach(file IN LISTS files)
  file(STRINGS ${file} lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<](offload|nvme|gpu)/")
  foreach(line IN LISTS lines)
    string(STRIP "${line}" line)
    list(APPEND offending "${file}: ${line}")
  endforeach()
endforeach()
if(offending)
  list(JOIN offending "\n  " offending_text)
  message(FATAL_ERROR "these include the engine's headers; include schedule/ instead "
    "(Note [Schedule contract] in schedule/schedule.h):\n  ${offending_text}")
endif()
list(LENGTH files count)
message(STATUS "${count} files in ${DIR}: none includes offload/, nvme/ or gpu/")
