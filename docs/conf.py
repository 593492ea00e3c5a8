"""Sphinx configuration of the jaxrl_llm docs site (MyST Markdown pages, API reference from
the docstrings, configuration reference from `jaxrl_llm/train/config.py`).

  pip install -c constraints.txt -e '.[docs]'
  sphinx-build -W -b html docs docs/_build/html     # strict: any warning fails
"""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path[:0] = [str(DOCS.parent), str(DOCS / "_ext")]

import config_reference  # noqa: E402

config_reference.write(DOCS / "reference" / "configuration.md")

project = "jaxrl_llm"
author = "the jaxrl_llm developers"
extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "dollarmath"]
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the docstrings say what each argument is
html_theme = "furo"
html_title = "jaxrl_llm"
suppress_warnings = []
nitpicky = False


def _verbatim(app, what, name, obj, options, lines):
  """Docstrings here are plain text with aligned ASCII equations (rlax's style): shown as
  they are, in a literal block, rather than read as reStructuredText."""
  if lines:
    lines[:] = ["::", "", *(f"   {line}" for line in lines), ""]


def setup(app):
  app.connect("autodoc-process-docstring", _verbatim)
