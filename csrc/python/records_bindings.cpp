// Python glue for the records code: file readers/writers, Example encoding
// and parsing, and RecordInput. Everything heavy runs with the GIL released
// (reading batches, writing batches, parsing, waiting for RecordInput); the
// GIL is held only to convert Python objects.
//
// RecordError (C++) becomes the torch_stage.errors class for its kind, with
// the path / offset / record_index / key attributes copied over; invalid
// arguments become ValueError.
#include <ATen/ops/from_blob.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "python/bindings.h"
#include "records/example.h"
#include "records/parse_example.h"
#include "records/record_input.h"
#include "records/record_io.h"

namespace py = pybind11;

namespace torch_stage::python {
namespace {

using records::Compression;
using records::FeatureKind;
using records::RecordBatch;
using records::RecordError;
using records::RecordErrorKind;
using Clock = std::chrono::steady_clock;

const char* python_class(RecordErrorKind kind) {
  switch (kind) {
    case RecordErrorKind::kNotFound:
    case RecordErrorKind::kIo:
    case RecordErrorKind::kNoRecords:
      return "RecordFileError";
    case RecordErrorKind::kTruncated:
    case RecordErrorKind::kCorrupt:
      return "CorruptRecordError";
    case RecordErrorKind::kNotExample:
      return "ExampleParseError";
    case RecordErrorKind::kMissingFeature:
    case RecordErrorKind::kWrongType:
    case RecordErrorKind::kWrongSize:
      return "FeatureError";
    default:
      return "RecordError";
  }
}

// Sets the Python error for `e` (the GIL is held: pybind11 runs exception
// translators after reacquiring it).
void set_python_error(const RecordError& e) {
  if (e.kind() == RecordErrorKind::kInvalidArgument) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return;
  }
  py::object cls =
      py::module_::import("torch_stage.errors").attr(python_class(e.kind()));
  py::object err = cls(e.what());
  auto opt_str = [](const std::string& s) -> py::object {
    return s.empty() ? py::none() : py::object(py::str(s));
  };
  auto opt_int = [](int64_t v) -> py::object {
    return v < 0 ? py::none() : py::object(py::int_(v));
  };
  err.attr("path") = opt_str(e.path());
  err.attr("offset") = opt_int(e.offset());
  err.attr("record_index") = opt_int(e.record_index());
  err.attr("key") = opt_str(e.key());
  err.attr("kind") = py::str(records::to_string(e.kind()));
  PyErr_SetObject(cls.ptr(), err.ptr());
}

// The flat uint8 data and int64 offsets of a batch, sharing the vectors'
// storage (no copy): both tensors keep the batch alive.
py::tuple batch_to_tensors(RecordBatch&& batch) {
  auto holder = std::make_shared<RecordBatch>(std::move(batch));
  auto keep = [holder](void*) {};
  const auto bytes = static_cast<int64_t>(holder->data.size());
  const auto n = static_cast<int64_t>(holder->offsets.size());
  at::Tensor data = at::from_blob(
      holder->data.data(), {bytes}, keep, at::TensorOptions().dtype(at::kByte));
  at::Tensor offsets = at::from_blob(
      holder->offsets.data(), {n}, keep, at::TensorOptions().dtype(at::kLong));
  return py::make_tuple(data, offsets);
}

Compression compression_of(const py::object& c) {
  return records::parse_compression(
      c.is_none() ? std::string() : c.cast<std::string>());
}

// ------------------------------------------------------------- files

class FileReader {
 public:
  FileReader(const std::string& path, const py::object& compression)
      : reader_(path, compression_of(compression)) {}

  py::object read() {
    if (!reader_.read(&record_)) {
      return py::none();
    }
    return py::bytes(record_);
  }

  // Up to max_records records as (data, offsets); offsets has one entry
  // (and data none) at the end of the file.
  py::tuple read_batch(int64_t max_records) {
    if (max_records < 1) {
      throw py::value_error(
          "batch_size must be >= 1, got " + std::to_string(max_records));
    }
    if (pending_) {
      std::rethrow_exception(std::exchange(pending_, nullptr));
    }
    RecordBatch batch;
    {
      ReleasedGil no_gil;
      try {
        while (static_cast<int64_t>(batch.size()) < max_records &&
               reader_.read(&record_)) {
          batch.data.insert(batch.data.end(), record_.begin(), record_.end());
          batch.offsets.push_back(static_cast<int64_t>(batch.data.size()));
        }
      } catch (const std::exception&) {
        // The records read before a bad one are delivered first, as reading
        // one at a time would; the error comes with the next call.
        if (batch.size() == 0) {
          throw;
        }
        pending_ = std::current_exception();
      }
    }
    return batch_to_tensors(std::move(batch));
  }

  const records::RecordReader& reader() const {
    return reader_;
  }

 private:
  records::RecordReader reader_;
  std::string record_;
  std::exception_ptr pending_; // an error that follows the last batch
};

class FileWriter {
 public:
  FileWriter(const std::string& path, const py::object& compression)
      : writer_(path, compression_of(compression)) {}

  void write(const py::buffer& record) {
    const py::buffer_info info = record.request();
    if (info.ndim > 1 || (info.ndim == 1 && info.strides[0] != info.itemsize)) {
      throw py::value_error(
          "a record must be contiguous bytes (bytes, bytearray, memoryview, "
          "a 1-D uint8 array)");
    }
    writer_.write(
        info.ptr,
        static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize));
  }

  void write_batch(const at::Tensor& data, const at::Tensor& offsets) {
    const auto refs = records::record_refs(data, offsets);
    ReleasedGil no_gil;
    for (const auto& r : refs) {
      writer_.write(r.data, r.size);
    }
  }

  void flush() {
    ReleasedGil no_gil;
    writer_.flush();
  }
  void close() {
    ReleasedGil no_gil;
    writer_.close();
  }
  int64_t records_written() const {
    return writer_.records_written();
  }
  const std::string& path() const {
    return writer_.path();
  }

 private:
  records::RecordWriter writer_;
};

// ---------------------------------------------------------- examples

// items: [(key, kind, values)], kind 1 bytes (a list of bytes), 2 float,
// 3 int64 (lists of numbers): the facade normalises Python values.
py::bytes encode_example(const py::list& items) {
  records::ExampleEncoder encoder;
  for (const auto& item : items) {
    const auto t = item.cast<py::tuple>();
    const auto key = t[0].cast<std::string>();
    const auto kind = t[1].cast<int>();
    switch (kind) {
      case 1:
        encoder.add_bytes(key, t[2].cast<std::vector<std::string>>());
        break;
      case 2:
        encoder.add_float(key, t[2].cast<std::vector<float>>());
        break;
      case 3:
        encoder.add_int64(key, t[2].cast<std::vector<int64_t>>());
        break;
      default:
        throw py::value_error("unknown feature kind " + std::to_string(kind));
    }
  }
  return py::bytes(encoder.serialize());
}

// specs: [(key, kind, var_len, shape, default)], default None or a list
// (of numbers, or of bytes for kind 1). Checked again in C++.
std::vector<records::FeatureSpec> to_specs(const py::list& specs) {
  std::vector<records::FeatureSpec> out;
  for (const auto& item : specs) {
    const auto t = item.cast<py::tuple>();
    records::FeatureSpec s;
    s.key = t[0].cast<std::string>();
    s.kind = static_cast<FeatureKind>(t[1].cast<int>());
    s.var_len = t[2].cast<bool>();
    s.shape = t[3].cast<std::vector<int64_t>>();
    s.fixed_count = 1;
    for (int64_t d : s.shape) {
      s.fixed_count *= d;
    }
    if (!t[4].is_none()) {
      s.has_default = true;
      switch (s.kind) {
        case FeatureKind::kInt64:
          s.int64_default = t[4].cast<std::vector<int64_t>>();
          break;
        case FeatureKind::kFloat:
          s.float_default = t[4].cast<std::vector<float>>();
          break;
        default:
          s.bytes_default = t[4].cast<std::vector<std::string>>();
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

// What parse_example needs of a feature mapping, made once per mapping
// (the Python side keeps it): the C++ schema, and the keys and result type
// of each output. A parse call then converts nothing but its records.
struct ParsePlan {
  std::shared_ptr<const records::ParseSchema> schema;
  std::vector<py::object> keys; // str
  std::vector<bool> var_len;
  py::object ragged; // the Ragged named tuple type, for var-length outputs
};

ParsePlan make_plan(const py::list& specs, py::object ragged) {
  ParsePlan plan;
  plan.schema = records::make_parse_schema(to_specs(specs));
  for (const auto& s : plan.schema->specs()) {
    plan.keys.emplace_back(py::str(s.key));
    plan.var_len.push_back(s.var_len);
  }
  plan.ragged = std::move(ragged);
  return plan;
}

// records: (data, offsets) tensors, or a list/tuple of bytes objects (read
// in place: bytes are immutable and `keep` holds them while the GIL is
// released). Returns {key: tensor | Ragged(values, offsets, value_offsets)}.
py::dict parse_example(
    const py::object& records,
    const ParsePlan& plan,
    bool pin_memory) {
  std::vector<records::RecordRef> refs;
  std::vector<py::object> keep;
  at::Tensor data;
  if (py::isinstance<py::tuple>(records) && py::len(records) == 2 &&
      THPVariable_Check(records.cast<py::tuple>()[0].ptr())) {
    const auto t = records.cast<py::tuple>();
    data = t[0].cast<at::Tensor>();
    refs = records::record_refs(data, t[1].cast<at::Tensor>());
  } else {
    const auto seq = records.cast<py::sequence>();
    const size_t n = py::len(seq);
    refs.reserve(n);
    keep.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      py::object r = seq[i];
      if (!PyBytes_Check(r.ptr())) {
        throw py::type_error(
            "records[" + std::to_string(i) + "] is a " +
            Py_TYPE(r.ptr())->tp_name +
            ", expected bytes (or pass a RecordBatch / (data, offsets))");
      }
      refs.push_back(records::RecordRef{
          reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(r.ptr())),
          static_cast<size_t>(PyBytes_GET_SIZE(r.ptr()))});
      keep.push_back(std::move(r));
    }
  }
  std::vector<records::ParsedFeature> parsed;
  {
    ReleasedGil no_gil;
    parsed = records::parse_examples(refs, plan.schema, pin_memory);
  }
  py::dict out;
  auto opt = [](at::Tensor& t) -> py::object {
    return t.defined() ? py::cast(std::move(t)) : py::none();
  };
  for (size_t i = 0; i < parsed.size(); ++i) {
    auto& p = parsed[i];
    if (plan.var_len[i]) {
      out[plan.keys[i]] = plan.ragged(
          py::cast(std::move(p.values)), opt(p.offsets), opt(p.value_offsets));
    } else {
      out[plan.keys[i]] = py::cast(std::move(p.values));
    }
  }
  return out;
}

// ---------------------------------------------------------- RecordInput

using Input = std::shared_ptr<records::RecordInput>;

Input make_input(
    std::vector<std::string> patterns,
    int64_t parallelism,
    int64_t buffer_size,
    int64_t batch_size,
    const py::object& seed,
    double shift_ratio,
    const py::object& compression,
    int64_t shard_rank,
    int64_t shard_world,
    int64_t epochs,
    int64_t prefetch_batches) {
  records::RecordInputOptions o;
  o.file_patterns = std::move(patterns);
  o.parallelism = parallelism;
  o.buffer_size = buffer_size;
  o.batch_size = batch_size;
  if (seed.is_none()) {
    o.seed.reset();
  } else {
    o.seed = seed.cast<uint64_t>();
  }
  o.shift_ratio = shift_ratio;
  o.compression = compression_of(compression);
  o.shard_rank = shard_rank;
  o.shard_world = shard_world;
  o.epochs = epochs;
  o.prefetch_batches = prefetch_batches;
  ReleasedGil no_gil; // globbing may touch a slow file system
  return std::make_shared<records::RecordInput>(std::move(o));
}

// The next batch as (data, offsets); None when timeout_ms passed; raises
// StopIteration at the end of data or after close().
py::object take(const Input& input, int64_t timeout_ms) {
  RecordBatch batch;
  const BufferStatus status = wait_releasing_gil(
      timeout_ms, BufferStatus::kTimeout, [&](Clock::time_point t) {
        return input->try_take_until(&batch, t);
      });
  switch (status) {
    case BufferStatus::kOk:
      return batch_to_tensors(std::move(batch));
    case BufferStatus::kTimeout:
      return py::none();
    default:
      throw py::stop_iteration();
  }
}

py::dict input_stats(const Input& input) {
  const auto s = input->stats();
  py::dict d;
  d["files"] = s.files;
  d["readers"] = s.readers;
  d["records_read"] = s.records_read;
  d["records_out"] = s.records_out;
  d["batches_out"] = s.batches_out;
  d["errors"] = s.errors;
  d["pool_size"] = s.pool_size;
  d["epoch"] = s.epoch;
  d["buffer_bytes"] = s.buffer_bytes;
  d["records_compacted"] = s.records_compacted;
  d["started"] = s.started;
  d["closed"] = s.closed;
  return d;
}

} // namespace

void init_records(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (const RecordError& e) {
      set_python_error(e);
    }
  });

  py::class_<FileReader>(m, "_RecordFileReader")
      .def(
          py::init<const std::string&, const py::object&>(),
          py::arg("path"),
          py::arg("compression") = py::none())
      .def(
          "read",
          &FileReader::read,
          "The next record as bytes, or None at the end")
      .def(
          "read_batch",
          &FileReader::read_batch,
          py::arg("max_records"),
          "Up to max_records records as (uint8 data, int64 offsets)")
      .def_property_readonly(
          "path", [](const FileReader& r) { return r.reader().path(); })
      .def_property_readonly(
          "offset", [](const FileReader& r) { return r.reader().offset(); })
      .def_property_readonly(
          "index", [](const FileReader& r) { return r.reader().index(); });

  py::class_<FileWriter>(m, "_RecordFileWriter")
      .def(
          py::init<const std::string&, const py::object&>(),
          py::arg("path"),
          py::arg("compression") = py::none())
      .def("write", &FileWriter::write, py::arg("record"))
      .def(
          "write_batch",
          &FileWriter::write_batch,
          py::arg("data"),
          py::arg("offsets"))
      .def("flush", &FileWriter::flush)
      .def("close", &FileWriter::close)
      .def_property_readonly("records_written", &FileWriter::records_written)
      .def_property_readonly("path", &FileWriter::path);

  m.def(
      "_match_files",
      [](std::vector<std::string> patterns) {
        ReleasedGil no_gil;
        return records::match_files(patterns);
      },
      py::arg("patterns"));
  m.def("_encode_example", &encode_example, py::arg("items"));
  py::class_<ParsePlan>(m, "_ParsePlan")
      .def(py::init(&make_plan), py::arg("specs"), py::arg("ragged"));
  m.def(
      "_parse_example",
      &parse_example,
      py::arg("records"),
      py::arg("plan"),
      py::arg("pin_memory"));

  py::class_<records::RecordInput, Input>(m, "_RecordInput")
      .def(
          py::init(&make_input),
          py::arg("patterns"),
          py::arg("parallelism"),
          py::arg("buffer_size"),
          py::arg("batch_size"),
          py::arg("seed"),
          py::arg("shift_ratio"),
          py::arg("compression"),
          py::arg("shard_rank"),
          py::arg("shard_world"),
          py::arg("epochs"),
          py::arg("prefetch_batches"))
      .def("take", &take, py::arg("timeout_ms") = -1)
      .def(
          "start",
          [](const Input& input) {
            ReleasedGil no_gil;
            input->start();
          })
      .def(
          "close",
          [](const Input& input) {
            // Joining waits for threads that never need the GIL; releasing
            // it lets other Python threads run meanwhile.
            ReleasedGil no_gil;
            input->close();
          })
      .def("stats", &input_stats)
      .def_property_readonly(
          "files", [](const Input& input) { return input->files(); });
}

} // namespace torch_stage::python
