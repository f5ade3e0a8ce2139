"""The documentation site builds as CI and Read the Docs build it: Sphinx with warnings as
errors, every page's code run by a real kernel (myst-nb), the references generated from the
code, and nothing loaded from another host."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_magic.spec import OPTIONS

pytestmark = pytest.mark.kernel

DOCS = Path(__file__).resolve().parents[1] / "docs"


def build(source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(source), str(out)], capture_output=True, text=True, timeout=900, cwd=out.parent)


def test_the_site_builds_with_its_examples_run_and_its_references_taken_from_the_code(
        tmp_path):
    out = tmp_path / "html"
    done = build(DOCS, out)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    # the how-to's cells ran: a real job's record, and the values it returned
    first = (out / "how-to" / "first-job.html").read_text()
    assert "elastic-record" in first and "succeeded" in first
    assert "{0: 3.0, 1: 3.0}" in first
    resume = (out / "how-to" / "resume.html").read_text()  # a crash, resumed at the commit
    assert "restarting the group (1/1) after rank 1" in resume
    assert "(1, {0: (10, 20), 1: (10, 20)})" in resume
    grown = html.unescape((out / "how-to" / "several-machines.html").read_text())
    assert "(0, 3, 'head')" in grown, grown[-3000:]  # --launcher local: three machines
    assert "'local1#1')" in grown and "'local2#2')" in grown
    assert "launcher: no allocation left" in grown
    # every option of spec.OPTIONS, with its flag, as the magic's parser has it
    options = (out / "reference" / "options.html").read_text()
    for option in OPTIONS:
        assert f">{option.name}<" in options.replace('<span class="pre">', "").replace(
            "</span>", ""), option.name
        if option.flag:
            assert option.flag in options, option.flag
    cli = (out / "reference" / "cli.html").read_text()
    assert "elastic-magic join" in cli and "--token-file" in cli
    api = (out / "reference" / "api.html").read_text()
    assert 'id="elastic_magic.launch"' in api and 'id="elastic_magic.State"' in api
    for page in out.rglob("*.html"):  # a site that works offline, as it was built
        assert not re.search(r"<script[^>]+src=\"https?://", page.read_text()), page


def test_an_example_that_breaks_fails_the_build(tmp_path):
    source = tmp_path / "docs"
    source.mkdir()
    shutil.copy(DOCS / "conf.py", source)
    shutil.copytree(DOCS / "_ext", source / "_ext")
    (source / "index.md").write_text(
        "---\nfile_format: mystnb\nkernelspec:\n  name: python3\n  display_name: Python 3\n"
        "---\n\n# A page\n\n```{code-cell} ipython3\nraise ValueError('a broken example')\n"
        "```\n")
    done = build(source, tmp_path / "html")
    said = done.stdout + done.stderr
    assert done.returncode != 0 and "ExecutionError" in said, said[-3000:]
    assert str(source / "index.md") in said  # the page that broke
