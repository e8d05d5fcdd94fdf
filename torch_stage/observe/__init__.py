"""Seeing where time goes (``csrc/trace/``): the trace recorder
(:mod:`~torch_stage.observe.tracing`), the verdict on a stage's statistics
(:mod:`~torch_stage.observe.diagnose`) and the page of pictures
(:mod:`~torch_stage.observe.report`, ``python -m torch_stage.observe.report``).

The public names are gathered at the top level (``torch_stage.trace``,
``torch_stage.Trace``); this package only groups the modules.
"""
