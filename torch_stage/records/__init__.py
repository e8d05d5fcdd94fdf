"""TFRecord files and ``tf.train.Example`` in C++ (``csrc/records/``): files
(:mod:`~torch_stage.records.record_io`), Example parsing and encoding
(:mod:`~torch_stage.records.example`) and the shuffled threaded reader
(:mod:`~torch_stage.records.record_input`).

No TensorFlow or protobuf is needed. The public names are gathered at the
top level (``torch_stage.parse_example``, ``torch_stage.RecordInput``, ...);
this package only groups the modules.
"""
