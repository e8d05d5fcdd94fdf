#include "records/parse_example.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <string>

namespace torch_stage::records {
namespace {

// Records per parallel_for chunk: enough to amortise a task (~1 us) over
// records that take ~0.1-1 us each, few enough that a batch of a few
// hundred still spreads over the threads.
constexpr int64_t kGrain = 64;

[[noreturn]] void invalid(const std::string& message) {
  throw RecordError(RecordErrorKind::kInvalidArgument, message);
}

at::ScalarType dtype_of(FeatureKind kind) {
  switch (kind) {
    case FeatureKind::kInt64:
      return at::kLong;
    case FeatureKind::kFloat:
      return at::kFloat;
    default:
      return at::kByte;
  }
}

} // namespace

std::vector<RecordRef> record_refs(
    const at::Tensor& data,
    const at::Tensor& offsets) {
  if (!data.defined() || data.scalar_type() != at::kByte ||
      !data.device().is_cpu() || !data.is_contiguous() || data.dim() != 1) {
    invalid(
        "records data must be a 1-D contiguous CPU uint8 tensor, got " +
        (data.defined() ? std::string(c10::toString(data.scalar_type())) + " " +
                 data.device().str() + " of " + std::to_string(data.dim()) +
                 " dims" + (data.is_contiguous() ? "" : ", not contiguous")
                        : std::string("an undefined tensor")));
  }
  if (!offsets.defined() || offsets.scalar_type() != at::kLong ||
      !offsets.device().is_cpu() || !offsets.is_contiguous() ||
      offsets.dim() != 1 || offsets.numel() < 1) {
    invalid(
        "records offsets must be a 1-D contiguous CPU int64 tensor of N + 1 "
        "values, got " +
        (offsets.defined() ? std::string(c10::toString(offsets.scalar_type())) +
                 " of shape " + std::to_string(offsets.numel()) + " (" +
                 std::to_string(offsets.dim()) + " dims)"
                           : std::string("an undefined tensor")));
  }
  const auto* base = static_cast<const uint8_t*>(data.const_data_ptr());
  const auto* off = offsets.const_data_ptr<int64_t>();
  const int64_t n = offsets.numel() - 1;
  const int64_t size = data.numel();
  std::vector<RecordRef> refs(static_cast<size_t>(n));
  if (off[0] < 0 || off[0] > size) {
    invalid(
        "records offsets[0] must be in [0, " + std::to_string(size) +
        "], got " + std::to_string(off[0]));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (off[i + 1] < off[i] || off[i + 1] > size) {
      invalid(
          "records offsets must be non-decreasing and at most the data size " +
          std::to_string(size) + ", got offsets[" + std::to_string(i) +
          "] = " + std::to_string(off[i]) + ", offsets[" +
          std::to_string(i + 1) + "] = " + std::to_string(off[i + 1]));
    }
    refs[static_cast<size_t>(i)] = RecordRef{
        base + off[i], static_cast<size_t>(off[i + 1] - off[i]), base + size};
  }
  return refs;
}

std::shared_ptr<const ParseSchema> make_parse_schema(
    std::vector<FeatureSpec> specs) {
  for (const auto& s : specs) {
    if (s.var_len) {
      continue;
    }
    int64_t product = 1;
    for (int64_t d : s.shape) {
      if (d < 0) {
        invalid(
            "feature '" + s.key + "': shape dimensions must be >= 0, got " +
            std::to_string(d));
      }
      product *= d;
    }
    if (product != s.fixed_count) {
      invalid(
          "feature '" + s.key + "': the shape holds " +
          std::to_string(product) + " values, the fixed count is " +
          std::to_string(s.fixed_count));
    }
  }
  return std::make_shared<const ParseSchema>(std::move(specs));
}

std::vector<ParsedFeature> parse_examples(
    const std::vector<RecordRef>& records,
    const std::vector<FeatureSpec>& specs,
    bool pin_memory) {
  return parse_examples(records, make_parse_schema(specs), pin_memory);
}

std::vector<ParsedFeature> parse_examples(
    const std::vector<RecordRef>& records,
    const std::shared_ptr<const ParseSchema>& schema,
    bool pin_memory) {
  const std::vector<FeatureSpec>& specs = schema->specs();
  BatchParser parser(schema, records);
  const auto n = static_cast<int64_t>(records.size());
  auto options = [&](at::ScalarType t) {
    return at::TensorOptions().dtype(t).pinned_memory(pin_memory);
  };

  std::vector<ParsedFeature> result(specs.size());
  std::vector<FeatureOutput> outs(specs.size());
  for (size_t s = 0; s < specs.size(); ++s) {
    if (specs[s].var_len) {
      continue;
    }
    std::vector<int64_t> sizes{n};
    sizes.insert(sizes.end(), specs[s].shape.begin(), specs[s].shape.end());
    result[s].values = at::empty(sizes, options(dtype_of(specs[s].kind)));
    outs[s].values = result[s].values.data_ptr();
  }

  // Pass 1: every record into its slot of the fixed-length outputs.
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    parser.scan(static_cast<size_t>(begin), static_cast<size_t>(end), outs);
  });
  parser.check();
  parser.count();

  bool any_var = false;
  for (size_t s = 0; s < specs.size(); ++s) {
    if (!specs[s].var_len) {
      continue;
    }
    any_var = true;
    const bool bytes = specs[s].kind == FeatureKind::kBytes;
    const int64_t elements = parser.var_values(s);
    result[s].values = at::empty(
        {bytes ? parser.var_bytes(s) : elements},
        options(dtype_of(specs[s].kind)));
    result[s].offsets = at::empty({n + 1}, options(at::kLong));
    outs[s].values = result[s].values.data_ptr();
    outs[s].offsets = result[s].offsets.data_ptr<int64_t>();
    if (bytes) {
      result[s].value_offsets = at::empty({elements + 1}, options(at::kLong));
      outs[s].value_offsets = result[s].value_offsets.data_ptr<int64_t>();
    }
  }
  if (any_var) {
    // Pass 2: var-length features at their offsets. parallel_for calls
    // nothing for an empty range, but the empty batch still needs its
    // offsets written (to [0]).
    if (n == 0) {
      parser.fill(0, 0, outs);
    } else {
      at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
        parser.fill(static_cast<size_t>(begin), static_cast<size_t>(end), outs);
      });
    }
    parser.check();
  }
  return result;
}

} // namespace torch_stage::records
