// Parsing a batch of serialized tf.train.Example into tensors: the torch
// layer over BatchParser (example.h).
//
// Batch assembly without an extra copy (the idea of TensorFlow's
// parallel_stack in tf_cnn_benchmarks): the output tensors are allocated
// once, already batched (and pinned, when asked), and per-record work
// running on torch's intra-op threads (at::parallel_for) decodes each
// record straight into its slot. There is no per-record tensor and no
// collate step: a slow record delays only its own chunk, and collation and
// pinning are the same allocation.
//
// Threads: parse_examples() may be called from any thread, concurrently; it
// touches no global state beyond torch's thread pool and allocator. The
// caller keeps the record bytes alive and unchanged during the call. It
// needs no GIL (the Python binding releases it around the call).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "records/example.h"

namespace torch_stage::records {

// One feature's result. Fixed-length: `values` of shape (N, *spec.shape)
// (int64, float32 or uint8 for bytes). Var-length: `values` flat, `offsets`
// (N + 1) where record i holds elements offsets[i]:offsets[i + 1]; for bytes
// an element is a byte string and `value_offsets` (elements + 1) bounds each
// string inside `values`. Unused tensors are undefined.
struct ParsedFeature {
  at::Tensor values;
  at::Tensor offsets;
  at::Tensor value_offsets;
};

// Parses `records` against `specs`. `pin_memory` allocates the outputs in
// pinned host memory (the caller checks that an accelerator is there).
// Throws RecordError: kInvalidArgument for bad specs; for bad records the
// error of the lowest record index (deterministic whatever the threads).
std::vector<ParsedFeature> parse_examples(
    const std::vector<RecordRef>& records,
    const std::vector<FeatureSpec>& specs,
    bool pin_memory);
// The same with a schema made once (make_parse_schema) for many batches.
std::vector<ParsedFeature> parse_examples(
    const std::vector<RecordRef>& records,
    const std::shared_ptr<const ParseSchema>& schema,
    bool pin_memory);
// A schema for parse_examples: validates the specs, the shapes of
// fixed-length features included (RecordError kInvalidArgument).
std::shared_ptr<const ParseSchema> make_parse_schema(
    std::vector<FeatureSpec> specs);

// The records of a flat batch: record i is data[offsets[i]:offsets[i+1]].
// `data` must be a contiguous CPU uint8 tensor and `offsets` a contiguous
// CPU int64 tensor of N + 1 non-decreasing values within data; otherwise
// RecordError(kInvalidArgument) names what is wrong. The refs point into
// `data`, which must outlive them.
std::vector<RecordRef> record_refs(
    const at::Tensor& data,
    const at::Tensor& offsets);

} // namespace torch_stage::records
