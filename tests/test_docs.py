"""The documentation site builds as CI and Read the Docs build it: Sphinx with warnings as
errors, every page's code run by a real kernel (myst-nb), the references generated from the
code, and nothing loaded from another host."""

from __future__ import annotations

import html
import os
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
    # a wide terminal's: the pages must not take the width of the one that built them
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(source), str(out)], capture_output=True, text=True, timeout=900, cwd=out.parent,
        env=env)


@pytest.mark.timeout(900)  # three pages of real jobs, on a loaded 2-core machine
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
    # resized 2 -> 3 at a commit: the three ranks started there, at world size 3
    assert re.search(r"\(3, 1, 0\)", resume), resume[-3000:]
    assert re.search(r"\(\{0: \((\d+), 3\), 1: \(\1, 3\), 2: \(\1, 3\)\}, 40\)",
                     html.unescape(resume)), resume[-3000:]
    survivors = html.unescape((out / "how-to" / "survivors.html").read_text())
    assert "ranks 0 stayed in their processes" in survivors
    # rank 0 called train twice in one process (from step 0, then from the commit of step
    # 10); the new rank 1 once, from that commit, in another
    stayed = re.search(r"\(1, \{0: \(20, \[\((\d+), 0\), \(\1, 10\)\]\), "
                       r"1: \(20, \[\((\d+), 10\)\]\)\}\)", survivors)
    assert stayed and stayed[1] != stayed[2], survivors[-3000:]
    joined = html.unescape((out / "how-to" / "join-machines.html").read_text())
    assert "elastic-magic join 127.0.0.1:" in joined and "--token-file" in joined
    assert "(2, 2)" in joined and "({0: 2, 1: 2}, 2, 0)" in joined, joined[-3000:]
    # a tutorial, as the tests ran it: its outputs, and its records drawn in the page
    tutorial = html.unescape(re.sub(r"<script.*?</script>", "", (
        out / "tutorials" / "01_quickstart.html").read_text(), flags=re.S))
    assert "elastic-record" in tutorial and "epoch 4: loss" in tutorial
    assert "rank 1 failed: RuntimeError: simulated crash on rank 1" in tutorial
    live = html.unescape((out / "tutorials" / "03_elastic_training.html").read_text())
    assert "widget-view+json" not in live  # a dashboard live when saved shows as text
    grown = html.unescape((out / "how-to" / "several-machines.html").read_text())
    # --launcher local: three machines (which is node 0 is the rendezvous's choice)
    assert re.search(r"\(\d, 3, 'head'\)", grown), grown[-3000:]
    assert "'local1#1')" in grown and "'local2#2')" in grown
    assert "launcher: no allocation left" in grown
    detached = html.unescape((out / "how-to" / "detach.html").read_text())
    assert "[rank 0] step 10" in detached  # followed again after the detach
    assert "('succeeded', {0: 30.0, 1: 30.0})" in detached, detached[-3000:]
    pasted = html.unescape((out / "how-to" / "torchrun-script.html").read_text())
    assert "[rank 0] epoch 1 loss" in pasted and "[rank 1] epoch 1 loss" in pasted
    session = html.unescape((out / "how-to" / "sessions.html").read_text())
    assert re.search(r"\{0: (-?[\d.]+), 1: \1\}", session), session[-3000:]  # one model
    assert "torch.Size([1, 4])" in session and "session ended" in session
    hang = html.unescape(re.sub("<[^>]+>", "", (out / "how-to" / "debug-a-hang.html"
                                                ).read_text()))
    assert re.search(r"==> rank 1 <==\s+Thread MainThread \(main\), most recent call last:"
                     r"\s+Cell line 4, in <module>\s+time\.sleep\(0\.1\)", hang), hang[-3000:]
    assert "'stopped'" in hang
    # every option of spec.OPTIONS, with its flag, as the magic's parser has it
    options = (out / "reference" / "options.html").read_text()
    for option in OPTIONS:
        assert f">{option.name}<" in options.replace('<span class="pre">', "").replace(
            "</span>", ""), option.name
        if option.flag:
            assert option.flag in options, option.flag
    cli = (out / "reference" / "cli.html").read_text()
    assert "elastic-magic join" in cli and "--token-file" in cli
    widest = max(len(line) for block in re.findall(r"<pre>(.*?)</pre>", cli, re.S)
                 for line in html.unescape(re.sub("<[^>]+>", "", block)).splitlines())
    assert widest <= 95  # the help as a reader's page has it, whatever the build's terminal
    launchers = html.unescape((out / "reference" / "launchers.html").read_text())
    for name in ("local", "slurm", "ssh"):  # each registered launcher, a table's rows
        assert f"<code class=\"docutils literal notranslate\"><span class=\"pre\">{name}</span>" \
            in launchers, name
    from elastic_magic.launchers import local, slurm, ssh
    rows = 1 + sum(len(module.OPTIONS) for module in (local, slurm, ssh))  # with the header
    assert launchers.count("<tr") == rows and "sbatch --partition" in launchers
    assert 'id="elastic_magic.launchers.Launcher.start"' in launchers
    api = (out / "reference" / "api.html").read_text()
    assert 'id="elastic_magic.launch"' in api and 'id="elastic_magic.State"' in api
    for page in out.rglob("*.html"):  # a site that works offline, as it was built
        assert not re.search(r"<script[^>]+src=\"https?://", page.read_text()), page
    look_at_pages_in_chromium(out)


def look_at_pages_in_chromium(out: Path) -> None:
    """The index, a tutorial and a reference page as a reader's Chromium shows them: the
    theme's style and navigation there, every picture loaded; screenshots kept."""
    from playwright.sync_api import expect
    from test_browser import ARTIFACTS, chromium_page, require_chromium

    require_chromium()
    with chromium_page() as page:
        for name in ("index", "tutorials/index", "tutorials/01_quickstart", "reference/options",
                     "explanation/dashboard"):
            page.goto((out / f"{name}.html").as_uri())
            expect(page.locator("nav.bd-docs-nav, .bd-sidebar-primary")).not_to_have_count(0)
            expect(page.locator("article h1")).to_have_count(1)
            themed = page.evaluate("getComputedStyle(document.documentElement)"
                                   ".getPropertyValue('--pst-color-primary')")
            assert themed.strip(), name  # the pydata theme's stylesheet was loaded
            for picture in page.locator("article img").all():
                assert picture.evaluate("(img) => img.complete && img.naturalWidth > 0"), (
                    name, picture.get_attribute("src"))
            page.screenshot(path=str(ARTIFACTS / f"docs-{name.replace('/', '-')}.png"),
                            full_page=False)


def test_an_example_that_breaks_fails_the_build(tmp_path):
    source = tmp_path / "docs"
    source.mkdir()
    shutil.copy(DOCS / "conf.py", source)
    shutil.copytree(DOCS / "_ext", source / "_ext")
    shutil.copytree(DOCS / "_static", source / "_static")
    (source / "index.md").write_text(
        "---\nfile_format: mystnb\nkernelspec:\n  name: python3\n  display_name: Python 3\n"
        "---\n\n# A page\n\n```{code-cell} ipython3\nraise ValueError('a broken example')\n"
        "```\n")
    done = build(source, tmp_path / "html")
    said = done.stdout + done.stderr
    assert done.returncode != 0 and "ExecutionError" in said, said[-3000:]
    assert str(source / "index.md") in said  # the page that broke


@pytest.mark.unit
def test_the_environment_page_names_every_variable_the_code_reads_or_sets():
    """Every ``ELASTIC_MAGIC_*`` name of the package, and every variable a worker is
    given as torchrun gives it, is on the page; the page names no variable the code has
    not (a hand-written table that could drift, checked against the code)."""
    page = (DOCS / "reference" / "environment.md").read_text()
    source = "\n".join(p.read_text() for p in (DOCS.parent / "elastic_magic").rglob("*.py"))
    ours = set(re.findall(r"\bELASTIC_MAGIC_[A-Z_]+\b", source))
    environment = (DOCS.parent / "elastic_magic" / "agent" / "node" / "environment.py")
    torchrun = set(re.findall(r'^\s+"([A-Z_]+)": ', environment.read_text(), re.M))
    on_page = set(re.findall(r"`([A-Z][A-Z_]+[A-Z])`", page))
    assert ours | torchrun <= on_page, (ours | torchrun) - on_page
    known = ours | torchrun | {"XDG_CACHE_HOME", "XDG_CONFIG_HOME", "SLURM_JOB_ID",
                               "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"}
    assert on_page <= known, on_page - known


@pytest.mark.unit
def test_the_tutorials_pages_are_the_course_as_the_tests_ran_it():
    """docs/tutorials/ holds each notebook of the course with the outputs of a test's run
    (docs/refresh.py): the same cells as notebooks/, every code cell run, in order, and no
    error but where the course shows one on purpose. A saved notebook is shared: no job
    token (32 hex digits) is in it, but the widgets' ids."""
    import nbformat

    course = sorted((DOCS.parent / "notebooks").glob("*.ipynb"))
    kept = sorted((DOCS / "tutorials").glob("*.ipynb"))
    assert [p.name for p in kept] == [p.name for p in course], \
        "run `python docs/refresh.py tutorials`"
    for ours, theirs in zip(course, kept, strict=True):
        nb, ran = nbformat.read(ours, as_version=4), nbformat.read(theirs, as_version=4)
        assert [(c.cell_type, c.source) for c in ran.cells] == [
            (c.cell_type, c.source) for c in nb.cells], \
            f"{theirs.name} is not the course's: run `python docs/refresh.py tutorials`"
        code = [c for c in ran.cells if c.cell_type == "code"]
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), theirs.name
        for cell in code:
            errors = [o for o in cell.outputs if o.output_type == "error"]
            assert not errors or "raises-exception" in cell.metadata.get("tags", []), \
                (theirs.name, cell.source[:80])
        saved = theirs.read_text()
        widgets = ran.metadata.get("widgets", {}).get(
            "application/vnd.jupyter.widget-state+json", {}).get("state", {})
        hex32 = set(re.findall(r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])", saved))
        assert hex32 <= set(widgets), (theirs.name, hex32 - set(widgets))
