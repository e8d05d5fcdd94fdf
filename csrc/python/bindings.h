// Entry points of the pybind11 glue, one per concern, called from module.cpp.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace torch_stage::python {

// _StagingAreaHandle: the GIL-aware Python fast path of StagingArea.
void init_staging(pybind11::module_& m);

// _Stage: Python sources, transforms and consumers of a Stage; stage pools.
void init_stage(pybind11::module_& m);

// TFRecord files, Example encoding/parsing and RecordInput.
void init_records(pybind11::module_& m);

} // namespace torch_stage::python
