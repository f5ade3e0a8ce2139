"""Sphinx configuration of elastic_magic's documentation site.

Build it as CI does: ``sphinx-build -W -b html docs docs/_build/html``. It needs no network
(no intersphinx inventories are fetched). Pages that show code are MyST notebooks that a real
kernel runs at build time (myst-nb), so an example that breaks fails the build; the flag, CLI
and API references are generated from the code (``_ext/elastic_reference.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "elastic_magic"
author = "the elastic_magic developers"
copyright = "2026, the elastic_magic developers"

extensions = [
    "myst_nb",  # Markdown pages, and notebooks run at build time
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the API's Args/Returns/Raises docstrings
    "elastic_reference",
]
exclude_patterns = ["_build", "jupyter_execute", ".jupyter_cache", "**.ipynb_checkpoints"]

# Every page with code cells runs in a fresh kernel at each build; an error fails it.
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_timeout = 300
# The tutorials are the course's notebooks as the tests ran them, outputs kept
# (docs/refresh.py): shown, not run again.
nb_execution_excludepatterns = ["tutorials/*.ipynb"]
nb_merge_streams = True
# A finished job's dashboard is replaced by its record (HTML): no widget is left to load,
# so no page fetches the widget manager's scripts from a CDN.
nb_ipywidgets_js: dict[str, dict[str, str]] = {}
# A dashboard still live when a tutorial was saved shows as its text (where the job
# stands), not as a widget the page would have no script to draw.
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
myst_enable_extensions = ["colon_fence", "deflist"]
nb_render_markdown_format = "myst"  # a cell's Markdown output may be a table (the launchers')
myst_heading_anchors = 3

autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "pydata_sphinx_theme"
html_title = "elastic_magic"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "footer_start": ["copyright"],
    "footer_end": [],
}
html_static_path = ["_static"]
html_css_files = ["elastic.css"]
smartquotes = False  # flags keep their two hyphens: --nproc, not an en dash
