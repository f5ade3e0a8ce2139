"""Take again what the docs keep from the tests' own runs::

    .venv/bin/python docs/refresh.py                # both
    .venv/bin/python docs/refresh.py screenshots    # docs/_static/screenshots/*.png
    .venv/bin/python docs/refresh.py tutorials      # docs/tutorials/*.ipynb, with outputs

The screenshots are those the browser tests took (real JupyterLab, real jobs, Debian's
Chromium) while they checked what each picture shows; the tutorials are the course in
``notebooks/`` as the notebook tests executed it in a real kernel and checked its outputs.
Nothing is replaced unless every test it comes from passed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Kept:
    """What the docs keep from some tests: the variable that names the folder the tests
    write into, the files to take (the test's name -> the docs' name) and where they go."""

    variable: str
    tests: tuple[str, ...]
    files: dict[str, str]
    folder: Path


SCREENSHOTS = Kept(
    "ELASTIC_MAGIC_SCREENSHOTS",
    ("tests/test_browser.py::test_dashboard_live_in_jupyterlab_and_stop_button",
     "tests/test_browser.py::test_elastic_jobs_panel_lists_a_background_job_and_stops_it",
     "tests/test_browser.py::test_a_detached_training_is_attached_from_the_panel_after_a"
     "_kernel_restart"),
    {"dashboard-after-reload.png": "dashboard.png",  # a resized job, live after a reload
     "dashboard-live-chart-light.png": "charts.png",
     "dashboard-live-chart-dark.png": "charts-dark.png",
     "elastic-jobs-panel.png": "panel.png",
     "elastic-jobs-panel-detached.png": "panel-detached.png",
     "record-dark.png": "record-dark.png"},
    DOCS / "_static" / "screenshots")

TUTORIALS = Kept(
    "ELASTIC_MAGIC_TUTORIALS",
    ("tests/test_notebooks.py",),
    {p.name: p.name for p in sorted((ROOT / "notebooks").glob("*.ipynb"))},
    DOCS / "tutorials")

WHAT = {"screenshots": SCREENSHOTS, "tutorials": TUTORIALS}


def refresh(kept: Kept) -> int:
    with tempfile.TemporaryDirectory() as taken:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", *kept.tests],
                             cwd=ROOT, env={**os.environ, kept.variable: taken})
        if run.returncode != 0:
            print(f"{' '.join(kept.tests)} failed: nothing was replaced", file=sys.stderr)
            return run.returncode
        missing = [name for name in kept.files if not (Path(taken) / name).exists()]
        if missing:  # a test that skipped (a package not installed) wrote nothing
            print(f"no {', '.join(missing)} from the tests (skipped?): nothing was replaced",
                  file=sys.stderr)
            return 1
        kept.folder.mkdir(parents=True, exist_ok=True)
        for name, docs_name in kept.files.items():
            shutil.copyfile(Path(taken) / name, kept.folder / docs_name)
            print((kept.folder / docs_name).relative_to(ROOT))
    return 0


def main(argv: list[str]) -> int:
    unknown = [a for a in argv if a not in WHAT]
    if unknown:
        print(f"usage: docs/refresh.py [{' | '.join(WHAT)}] ... (not {unknown[0]!r})",
              file=sys.stderr)
        return 2
    for name in argv or list(WHAT):
        if code := refresh(WHAT[name]):
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
