"""Take the docs' and the README's screenshots again: the browser tests run (real JupyterLab,
real jobs, Debian's Chromium) and the pictures they take of the dashboard, the Elastic jobs
panel and a saved record are copied into ``docs/_static/screenshots``::

    .venv/bin/python docs/screenshots.py

Every picture is one a test took while it checked what the picture shows."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEPT = Path(__file__).resolve().parent / "_static" / "screenshots"
# the test's picture -> the name the docs give it
PICTURES = {
    "dashboard-after-reload.png": "dashboard.png",  # a resized job, live after a page reload
    "dashboard-live-chart-light.png": "charts.png",
    "dashboard-live-chart-dark.png": "charts-dark.png",
    "elastic-jobs-panel.png": "panel.png",
    "elastic-jobs-panel-detached.png": "panel-detached.png",
    "record-dark.png": "record-dark.png",
}
TESTS = ["tests/test_browser.py::test_dashboard_live_in_jupyterlab_and_stop_button",
         "tests/test_browser.py::test_elastic_jobs_panel_lists_a_background_job_and_stops_it",
         "tests/test_browser.py::test_a_detached_training_is_attached_from_the_panel_after_a"
         "_kernel_restart"]


def main() -> int:
    with tempfile.TemporaryDirectory() as taken:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", *TESTS],
                             cwd=ROOT, env={**os.environ, "ELASTIC_MAGIC_SCREENSHOTS": taken})
        if run.returncode != 0:
            print("the browser tests failed: no screenshot was replaced", file=sys.stderr)
            return run.returncode
        KEPT.mkdir(parents=True, exist_ok=True)
        for picture, name in PICTURES.items():
            shutil.copyfile(Path(taken) / picture, KEPT / name)
            print(f"docs/_static/screenshots/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
