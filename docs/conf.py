"""Sphinx configuration: reference pages from the docstrings (autodoc,
autosummary, Google-style sections through napoleon) and the guide pages in
Markdown (MyST). ``make docs`` builds the HTML into build/docs;
tests/test_docs.py builds it with warnings as errors."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch_stage  # noqa: E402

project = "torch_stage"
version = release = torch_stage.__version__
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
# One page per public name, written to docs/generated (not committed).
autosummary_generate = True
autodoc_default_options = {"members": True, "undoc-members": False}
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" sections as fields of the class, not objects of their own
# (dataclass and NamedTuple fields are documented as members already).
napoleon_use_ivar = True
myst_heading_anchors = 3
html_theme = "alabaster"
html_title = f"torch_stage {release}"
# Pages are linked by their Markdown paths; the README's pictures live here.
html_static_path = []
