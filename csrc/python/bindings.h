// Entry points of the pybind11 glue, one per concern, called from module.cpp.
#pragma once

#include <c10/util/StringUtil.h>
#include <torch/csrc/jit/python/module_python.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/custom_class.h>

namespace torch_stage::python {

// The C++ object behind a torch.ScriptObject of custom class T (`name` is
// the class's Python name, for the TypeError when it is something else).
template <typename T>
c10::intrusive_ptr<T> custom_class_from(
    pybind11::handle obj,
    const char* name) {
  auto object = torch::jit::as_object(obj);
  if (!object.has_value()) {
    throw pybind11::type_error(
        c10::str("expected a ", name, ", got ", Py_TYPE(obj.ptr())->tp_name));
  }
  c10::IValue value(object->_ivalue());
  if (value.type() != c10::getCustomClassType<c10::intrusive_ptr<T>>()) {
    throw pybind11::type_error(
        c10::str("expected a ", name, ", got a ", value.type()->repr_str()));
  }
  return value.toCustomClass<T>();
}

// _StagingAreaHandle: the GIL-aware Python fast path of StagingArea.
void init_staging(pybind11::module_& m);

// _Stage: Python sources, transforms and consumers of a Stage; stage pools.
void init_stage(pybind11::module_& m);

// The multi-stream pass's stream ops without the torch.ops call overhead.
void init_streams(pybind11::module_& m);

// TFRecord files, Example encoding/parsing and RecordInput.
void init_records(pybind11::module_& m);

} // namespace torch_stage::python
