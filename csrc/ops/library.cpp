// The torch_stage operator library. Each concern registers its own schemas in
// its own file with TORCH_LIBRARY_FRAGMENT; this file owns the namespace and
// the build description.
#include <c10/macros/Macros.h>
#include <torch/library.h>
#include <torch/version.h>

#include <string>

// Written by setup.py into the build directory (TORCH_STAGE_BUILD_FLAGS,
// TORCH_STAGE_BUILD_TYPE); absent in builds that do not go through setup.py.
#if __has_include("torch_stage_build_config.h")
#include "torch_stage_build_config.h"
#endif
#ifndef TORCH_STAGE_BUILD_FLAGS
#define TORCH_STAGE_BUILD_FLAGS "unknown"
#endif
#ifndef TORCH_STAGE_BUILD_TYPE
#define TORCH_STAGE_BUILD_TYPE "unknown"
#endif

namespace torch_stage {
namespace {

#define TORCH_STAGE_STR_(x) #x
#define TORCH_STAGE_STR(x) TORCH_STAGE_STR_(x)

c10::Dict<std::string, std::string> build_info() {
  c10::Dict<std::string, std::string> info;
  info.insert(
      "torch_version",
      TORCH_STAGE_STR(TORCH_VERSION_MAJOR) "." TORCH_STAGE_STR(
          TORCH_VERSION_MINOR) "." TORCH_STAGE_STR(TORCH_VERSION_PATCH));
#if defined(__clang__)
  info.insert("compiler", "clang " __clang_version__);
#elif defined(__GNUC__)
  info.insert("compiler", "gcc " __VERSION__);
#else
  info.insert("compiler", "unknown");
#endif
  info.insert("cxx_standard", std::to_string(__cplusplus));
#ifdef _GLIBCXX_USE_CXX11_ABI
  info.insert("cxx11_abi", std::to_string(_GLIBCXX_USE_CXX11_ABI));
#endif
  info.insert("build_type", TORCH_STAGE_BUILD_TYPE);
  info.insert("build_flags", TORCH_STAGE_BUILD_FLAGS);
#ifdef NDEBUG
  info.insert("assertions", "off");
#else
  info.insert("assertions", "on");
#endif
  return info;
}

} // namespace

TORCH_LIBRARY(torch_stage, m) {
  m.def("build_info() -> Dict(str, str)", &build_info);
}

} // namespace torch_stage
