"""Staged prefetch (``csrc/staging/``): the bounded buffer
(:mod:`~torch_stage.staging.area`), background stages and ``staged()``
(:mod:`~torch_stage.staging.stage`), the drop-in DataLoader
(:mod:`~torch_stage.staging.loader`) and its training-framework helpers
(:mod:`~torch_stage.staging.integrations`).

The public names are gathered at the top level (``torch_stage.staged``,
``torch_stage.DataLoader``, ...); this package only groups the modules.
"""
