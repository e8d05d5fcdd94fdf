"""Multi-stream execution (``csrc/streams/``, ``csrc/schedule/``): the
annotations (:mod:`~torch_stage.streams.annotations`), ``multi_stream()``
(:mod:`~torch_stage.streams.multi_stream`), the FX pass that plans and
rewrites (:mod:`torch_stage.streams.fx`), the ``torch.compile`` backend
(:mod:`~torch_stage.streams.compile_backend`), CUDA graph replay
(:mod:`~torch_stage.streams.cuda_graphs`) and the stream sanitizer
(:mod:`~torch_stage.streams.sanitizer`).

The public names are gathered at the top level (``torch_stage.multi_stream``,
``torch_stage.stream``, ...); :mod:`torch_stage.streams.fx` is the public
home of the pass's pieces (``MultiStreamPass``, ``StreamPlan``, ``trace``).
"""
