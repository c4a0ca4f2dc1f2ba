# Compiler flags, sanitizers and optional-dependency probing shared by every module.

add_library(memplan_warnings INTERFACE)
target_compile_options(memplan_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
    -Wimplicit-fallthrough>)
# Note [Thread-safety analysis] (common/thread_annotations.h): clang checks the GUARDED_BY /
# REQUIRES annotations; gcc has no such analysis, and the annotations expand to nothing there.
if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  target_compile_options(memplan_warnings INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Wthread-safety>)
endif()
if(MEMPLAN_WERROR)
  target_compile_options(memplan_warnings INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
endif()
# Note [Unity builds]: scripts/setup.sh and scripts/test.sh build with CMAKE_UNITY_BUILD=ON (a
# target's sources compiled eight to a translation unit: the headers, json.hpp above all, are
# parsed once per eight files; at -O2 a third less compile CPU for the libraries, measured on a
# cold build: the planner's 173 -> 126 CPU-seconds, the estimator's 205 -> 138; test executables
# compile file by file). Each .cc is then #included into the
# unity file, and GCC takes a struct of a .cc that holds a type from that .cc's anonymous
# namespace for a header's: -Wsubobject-linkage, meaningless here, is off for those builds. Names
# in anonymous namespaces must differ between the .cc files of one target.
if(CMAKE_UNITY_BUILD AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  target_compile_options(memplan_warnings INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-Wno-subobject-linkage>)
endif()

if(MEMPLAN_SANITIZE)
  string(REPLACE ";" "," _san "${MEMPLAN_SANITIZE}")
  add_compile_options(-fsanitize=${_san} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  add_link_options(-fsanitize=${_san})
  set(MEMPLAN_SANITIZE_LINK_FLAG -fsanitize=${_san})
endif()

# memplan_optional(<NAME> <switch-var> <found-bool>): resolves AUTO/ON/OFF into MEMPLAN_HAVE_<NAME>.
function(memplan_optional name switch found)
  set(value "${${switch}}")
  if(value STREQUAL "OFF")
    set(have OFF)
  elseif(found)
    set(have ON)
  elseif(value STREQUAL "ON")
    message(FATAL_ERROR "${switch}=ON but ${name} was not found")
  else()
    set(have OFF)
  endif()
  set(MEMPLAN_HAVE_${name} ${have} PARENT_SCOPE)
endfunction()

find_package(PkgConfig QUIET)
set(_uring_found OFF)
if(PkgConfig_FOUND AND NOT MEMPLAN_WITH_URING STREQUAL "OFF")
  pkg_check_modules(LIBURING QUIET IMPORTED_TARGET liburing)
  set(_uring_found ${LIBURING_FOUND})
endif()
memplan_optional(URING MEMPLAN_WITH_URING "${_uring_found}")

set(_aio_found OFF)
if(NOT MEMPLAN_WITH_AIO STREQUAL "OFF")
  find_library(LIBAIO_LIBRARY aio)
  find_path(LIBAIO_INCLUDE_DIR libaio.h)
  if(LIBAIO_LIBRARY AND LIBAIO_INCLUDE_DIR)
    set(_aio_found ON)
  endif()
endif()
memplan_optional(AIO MEMPLAN_WITH_AIO "${_aio_found}")

set(_curl_found OFF)
if(NOT MEMPLAN_WITH_CURL STREQUAL "OFF")
  find_package(CURL QUIET)
  set(_curl_found ${CURL_FOUND})
endif()
memplan_optional(CURL MEMPLAN_WITH_CURL "${_curl_found}")

set(_cuda_found OFF)
if(NOT MEMPLAN_WITH_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  set(_cuda_found ${CUDAToolkit_FOUND})
endif()
memplan_optional(CUDA MEMPLAN_WITH_CUDA "${_cuda_found}")

set(_nccl_found OFF)
if(MEMPLAN_HAVE_CUDA AND NOT MEMPLAN_WITH_NCCL STREQUAL "OFF")
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  if(NCCL_LIBRARY AND NCCL_INCLUDE_DIR)
    set(_nccl_found ON)
  endif()
endif()
memplan_optional(NCCL MEMPLAN_WITH_NCCL "${_nccl_found}")

# The emulated GPU (tests/gpu_emulation) needs the real headers only: it stands in for the
# libraries, so CUDA and NCCL are "found" whenever their headers are.
if(MEMPLAN_GPU_EMULATION)
  if(NOT MEMPLAN_BUILD_TESTS)
    message(FATAL_ERROR "MEMPLAN_GPU_EMULATION=ON is a test build: it needs MEMPLAN_BUILD_TESTS=ON")
  endif()
  find_package(CUDAToolkit QUIET)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  if(NOT CUDAToolkit_INCLUDE_DIRS OR NOT NCCL_INCLUDE_DIR)
    message(FATAL_ERROR "MEMPLAN_GPU_EMULATION=ON needs the CUDA toolkit's and NCCL's headers "
      "(cuda_runtime_api.h, nccl.h); none were found")
  endif()
  set(MEMPLAN_HAVE_CUDA ON)
  set(MEMPLAN_HAVE_NCCL ON)
endif()

# memplan_module_tests(<module>): one doctest binary per module from its *_test.cc files.
function(memplan_module_tests module)
  if(NOT MEMPLAN_BUILD_TESTS)
    return()
  endif()
  file(GLOB test_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*_test.cc)
  if(NOT test_sources)
    return()
  endif()
  add_executable(${module}_test ${test_sources})
  # Test files repeat their helpers' names: one file at a time, even in a unity build.
  set_target_properties(${module}_test PROPERTIES UNITY_BUILD OFF)
  target_link_libraries(${module}_test PRIVATE memplan_${module} memplan_doctest_main
    memplan_warnings)
  target_compile_definitions(${module}_test PRIVATE
    MEMPLAN_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  add_test(NAME ${module}_test COMMAND ${module}_test)
  set_tests_properties(${module}_test PROPERTIES SKIP_RETURN_CODE 77 LABELS unit)
endfunction()
