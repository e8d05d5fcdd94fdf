"""torch_stage's reliability suite (``make torture``; its quick profile runs in
``make test`` through tests/test_reliability.py). See harness.py."""

import importlib

MODULES = ("volume", "shutdown", "signals", "hangs", "resume", "memory", "bad_input", "fuzz", "ddp")


def load_scenarios() -> None:
    """Import every scenario module, which registers its scenarios."""
    for m in MODULES:
        importlib.import_module(f"reliability.{m}")
