"""The dashboard and the JupyterLab extension in a real browser: JupyterLab on loopback,
Debian's Chromium driven by Playwright (through its executable path; no browser download).

Where Chromium is not installed these tests skip, saying how to install it; under CI
(``CI=true``) that is a failure instead, so CI cannot pass without running them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from conftest import wait_for_workers, wait_until_no_workers
from netns import network as network  # the fixture
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import expect, sync_playwright
from test_detach import cache as cache  # the fixture: this test's detached jobs' folder

from elastic_magic import JobSpec, attach
from elastic_magic.agent.handles import detached_folder, detached_launch
from elastic_magic.wire.payload import build_payload

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
# Where the screenshots go (docs/refresh.py points it at a folder of its own).
ARTIFACTS = Path(os.environ.get("ELASTIC_MAGIC_SCREENSHOTS") or ROOT / "test-artifacts")
# Where the Python package's build puts the JupyterLab extension (labextension/).
EXTENSION = ROOT / "elastic_magic" / "labextension"

CELLS = [
    "%load_ext elastic_magic",
    "%%elastic --nproc 2\nimport torch.distributed as dist\n"
    "print(f'\\x1b[32mhello\\x1b[0m from rank {dist.get_rank()}')",  # as FORCE_COLOR prints
    "%%elastic --nproc 2 --max-nproc 3 --max-restarts 1\n"
    "import sys, time, torch.distributed as dist, elastic_magic\n"
    "print(f'\\x1b[2K\\x1b[1;35mlong job\\x1b[0m rank {dist.get_rank()} ready', flush=True)\n"
    "print(f'a warning on rank {dist.get_rank()}', file=sys.stderr, flush=True)\n"
    "sampler = elastic_magic.ElasticSampler(10**6, batch_size=8)\n"
    "state = elastic_magic.State(step=0, sampler=sampler)\n"
    "for batch in sampler:  # training, as far as the charts can tell\n"
    "    state.step += 1\n"
    "    elastic_magic.log(loss=1.0 / state.step)\n"
    "    state.commit(every=5)\n"
    "    time.sleep(0.05)",
]

PANEL_CELLS = [
    "%load_ext elastic_magic",
    "%%elastic --bg --nproc 2 --max-nproc 3 -o job\nimport time\n"
    "print('background job up', flush=True)\ntime.sleep(600)",
    "x = 1",
    "%%elastic --nproc 1\nimport os, time\nprint('about to fail', flush=True)\n"
    "while not os.path.exists('fail-now'):\n    time.sleep(0.1)\nraise ValueError('boom')",
    "%elastic session start --nproc 2 --max-nproc 3",
    "%%elastic --nproc 1\nimport os, time\nprint('waiting for finish-now', flush=True)\n"
    "while not os.path.exists('finish-now'):\n    time.sleep(0.1)",
]

# WCAG contrast of an element's text against the first opaque background behind it.
CONTRAST = """(el) => {
  const rgb = (s) => s.match(/[\\d.]+/g).map(Number);
  const lum = ([r, g, b]) => [r, g, b].map((c) => {
    c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
  }).reduce((sum, c, i) => sum + c * [0.2126, 0.7152, 0.0722][i], 0);
  let node = el, bg = [255, 255, 255];
  while (node) {
    const c = rgb(getComputedStyle(node).backgroundColor);
    if (c.length < 4 || c[3] > 0) { bg = c; break; }
    node = node.parentElement;
  }
  const [a, b] = [lum(rgb(getComputedStyle(el).color)), lum(bg)].sort((x, y) => y - x);
  return (a + 0.05) / (b + 0.05);
}"""


def require(present: bool, reason: str) -> None:
    """Skip, saying why, where something the test needs is not installed; under CI (which
    installs everything) fail instead, so a green CI has run every browser test."""
    if present:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI runs the browser tests: {reason}")
    pytest.skip(reason)


def require_chromium() -> None:
    require(Path(CHROMIUM).exists(), "Debian's Chromium is not installed (apt-get install -y "
                                     "chromium); the browser tests drive it through its "
                                     "executable path")


def require_extension() -> None:
    require((EXTENSION / "package.json").exists(),
            "the JupyterLab extension is not built: pip install -e . builds it where node "
            "and npm are installed (apt-get install -y nodejs npm)")


@contextlib.contextmanager
def jupyterlab(tmp_path: Path, cells: list[str]) -> Iterator[str]:
    """JupyterLab on 127.0.0.1 with a private config, runtime and settings directory, and
    this tree's build of the extension ahead of any installed one."""
    require_chromium()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, tmp_path / "dashboard.ipynb")
    # No "get notified about Jupyter news?" prompt over what the screenshots show.
    news = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    runtime = tmp_path / "runtime"
    data = tmp_path / "data"
    (data / "labextensions").mkdir(parents=True)
    if (EXTENSION / "package.json").exists():
        (data / "labextensions" / "elastic-magic").symlink_to(EXTENSION)
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime),
               JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_PATH=os.pathsep.join(filter(None, [str(data),
                                                          os.environ.get("JUPYTER_PATH")])),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"))
    log = open(tmp_path / "lab.log", "w")  # noqa: SIM115 (closed below, after the server)
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
         "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0", f"--ServerApp.root_dir={tmp_path}",
         "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
    )
    try:
        info = None
        deadline = time.monotonic() + 60
        while info is None and time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "lab.log").read_text()
            files = list(runtime.glob("jpserver-*.json")) if runtime.exists() else []
            if files:
                info = json.loads(files[0].read_text())
            time.sleep(0.2)
        assert info, "JupyterLab did not start"
        yield f"http://127.0.0.1:{info['port']}/lab/tree/dashboard.ipynb?token={info['token']}"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # our own server, by its process group
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.fixture
def lab(tmp_path):
    with jupyterlab(tmp_path, CELLS) as url:
        yield url


@pytest.fixture
def panel_lab(tmp_path):
    require_extension()
    with jupyterlab(tmp_path, PANEL_CELLS) as url:
        yield url


@contextlib.contextmanager
def chromium_page() -> Iterator:
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync"],
        )
        try:
            # a context of its own: a test may close the page and open another in it
            context = browser.new_context(viewport={"width": 1280, "height": 1000})
            yield context.new_page()
        finally:
            browser.close()


def open_notebook(page, url: str, cells: int) -> None:
    """Open the notebook and wait until its Python kernel is idle. JupyterLab asks which
    kernel to start when starting the notebook's own failed or came before the kernelspecs
    had loaded (seen once in CI, on a loaded machine): we then choose the one it offers, the
    notebook's, as a user would."""
    page.goto(url)
    expect(page.locator(".jp-Notebook .jp-Cell")).to_have_count(cells, timeout=60_000)
    ask = page.locator(".jp-Dialog", has_text="Select kernel for")
    kernel = page.locator(".jp-Toolbar-kernelName")
    idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if ask.count():
            ask.get_by_role("button", name="Select Kernel").click()
        elif idle.count() and "Python 3" in kernel.inner_text():
            return
        time.sleep(0.2)
    page.screenshot(path=str(ARTIFACTS / "notebook-without-kernel.png"))
    raise AssertionError(f"the notebook's kernel did not start; toolbar says "
                         f"{kernel.all_inner_texts()}")


def use_theme(page, theme: str) -> None:
    """Switch JupyterLab's theme through its Settings menu, as a user does."""
    page.locator(".lm-MenuBar-itemLabel", has_text="Settings").click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Theme$")).hover()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{theme}$")).click()
    light = "false" if "Dark" in theme else "true"
    expect(page.locator(f"body[data-jp-theme-light='{light}']")).to_have_count(1,
                                                                             timeout=30_000)


def run_cell(page, index: int) -> None:
    """Run one cell. A keypress that lands while JupyterLab is still settling (a
    notification taking focus) is lost: the prompt then stays "[ ]:", and we press again.
    The prompt changes as soon as the frontend sends the request, so a cell never runs
    twice."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    prompt = cell.locator(".jp-InputArea-prompt")
    for _ in range(3):
        try:
            cell.locator(".jp-InputArea-editor").click()
        except PlaywrightTimeout:  # seen once in CI: a dialog in the way; say which
            page.screenshot(path=str(ARTIFACTS / f"cell-{index}-not-clickable.png"))
            dialogs = page.locator(".jp-Dialog")
            raise AssertionError(f"cell {index} cannot be clicked; dialogs open: "
                                 f"{dialogs.all_inner_texts()}") from None
        page.keyboard.press("Shift+Enter")
        try:
            expect(prompt).not_to_have_text("[ ]:", timeout=10_000)
            return
        except AssertionError:
            continue
    raise AssertionError(f"cell {index} did not start after three Shift+Enter")


def test_dashboard_live_in_jupyterlab_and_stop_button(lab):
    with chromium_page() as page:
        open_notebook(page, lab, 3)
        run_cell(page, 0)
        run_cell(page, 1)
        # A finished cell keeps the static record: world size 2, both ranks' output.
        record = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".elastic-record")
        expect(record).to_contain_text("succeeded", timeout=90_000)
        expect(record).to_contain_text("world size 2")
        expect(record).to_contain_text("hello from rank 0")
        expect(record).to_contain_text("hello from rank 1")
        # Colours as Jupyter shows a plain cell's, no escape codes as text.
        expect(record.locator("span[style*='color']").filter(has_text="hello").first
               ).to_have_text("hello")
        expect(record).not_to_contain_text("[32m")

        run_cell(page, 2)
        dash = page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".em-dash")
        expect(dash.locator("[data-em=state]")).to_have_text("running", timeout=90_000)
        expect(dash.locator("[data-em=world-size]")).to_have_text("world size 2")
        # The resize box starts at the job's size, not at the lower bound.
        expect(dash.locator("[data-em=scale-input]")).to_have_value("2")
        lines = dash.locator("[data-em=lines]")
        expect(lines).to_contain_text("long job rank 0 ready", timeout=30_000)
        expect(lines).to_contain_text("long job rank 1 ready")
        expect(lines.locator("span[style*='font-weight: bold']").first).to_have_text("long job")
        expect(lines).not_to_contain_text("[2K")
        dash.locator("[data-em=tab-1]").click()
        expect(lines).to_contain_text("long job rank 1 ready")
        expect(lines.locator(".em-stderr")).to_contain_text("a warning on rank 1")
        expect(lines).not_to_contain_text("rank 0 ready")
        assert len(wait_for_workers(2)) == 2
        dash.screenshot(path=str(ARTIFACTS / "dashboard.png"))

        # Resize from the dashboard: no State in this cell, so it restarts at 3 workers.
        dash.locator("[data-em=scale-input]").fill("3")
        dash.locator("[data-em=scale-button]").click()
        expect(dash.locator("[data-em=world-size]")).to_have_text("world size 3",
                                                                 timeout=60_000)
        expect(dash.locator("[data-em=tab-2]")).to_be_visible()
        expect(dash.locator("[data-em=state]")).to_have_text("running", timeout=60_000)
        expect(dash.locator("[data-em=restarts]")).to_have_text("restarts 0/1")
        workers = wait_for_workers(3)
        assert len(workers) == 3

        # A rank killed: the group restarts. The live chart marks the resize and the
        # failure on the world size's time axis, each with its sentence on hover.
        os.kill(workers[0].pid, signal.SIGKILL)  # a worker this test's job started
        expect(dash.locator("[data-em=restarts]")).to_have_text("restarts 1/1",
                                                                 timeout=60_000)
        expect(dash.locator("[data-em=state]")).to_have_text("running", timeout=60_000)
        assert len(wait_for_workers(3)) == 3
        world = dash.locator("[data-em=chart][data-chart=world_size]")
        marks = world.locator("[data-em=mark]")
        expect(marks.and_(page.locator("[data-kind='resize']"))).not_to_have_count(
            0, timeout=30_000)
        expect(marks.and_(page.locator("[data-kind='failed']"))).not_to_have_count(0)
        resize = marks.and_(page.locator("[data-kind='resize']")).first
        assert "3 workers" in resize.get_attribute("title"), resize.get_attribute("title")
        failed = marks.and_(page.locator("[data-kind='failed']")).first
        assert "rank" in failed.get_attribute("title"), failed.get_attribute("title")
        over = world.locator(".u-over")  # the cursor on the plot: the legend reads there
        box = over.bounding_box()
        over.hover(position={"x": box["width"] - 3, "y": box["height"] / 2})
        reading = world.locator(".u-legend .u-series").nth(1)
        expect(reading).to_contain_text("world size")
        expect(reading.locator(".u-value")).not_to_have_text("--")  # a size at the cursor
        assert int(world.get_attribute("data-points")) >= 4  # 2, down, 3, down, 3
        # Mid-training: steps/s and samples/s between commits and the logged loss, live.
        for chart in ("steps_per_second", "samples_per_second", "metric:loss"):
            drawn = dash.locator(f"[data-em=chart][data-chart='{chart}']")
            expect(drawn).to_have_count(1, timeout=30_000)
            expect(drawn).not_to_have_attribute("data-points", re.compile(r"^[01]$"))
        dash.locator("[data-em=charts-box]").screenshot(
            path=str(ARTIFACTS / "dashboard-live-chart-light.png"))
        # In the dark theme the chart is drawn again in the theme's ink.
        use_theme(page, "JupyterLab Dark")
        ink = dash.evaluate("(el) => getComputedStyle(el).color")
        expect(world).to_have_attribute("data-ink", ink, timeout=10_000)
        dash.locator("[data-em=charts-box]").screenshot(
            path=str(ARTIFACTS / "dashboard-live-chart-dark.png"))

        # Every rank's stacks while it runs; nothing stops (a subshell carries the click).
        dash.locator("[data-em=stacks-button]").click()
        stacks = dash.locator("[data-em=stacks]")
        expect(stacks.locator("[data-em=stacks-2]")).to_contain_text(
            re.compile(r"Cell line \d+, in <module>"), timeout=30_000)
        expect(stacks.locator("[data-em=stacks-0]")).to_contain_text("in <module>")
        expect(dash.locator("[data-em=stacks-button]")).to_have_text("Stacks")
        expect(dash.locator("[data-em=state]")).to_have_text("running")
        dash.screenshot(path=str(ARTIFACTS / "dashboard-stacks.png"))

        # Stop while the cell is still running: the click travels on a kernel subshell.
        dash.locator("[data-em=stop]").click()
        record = page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".elastic-record")
        expect(record).to_contain_text("stopped", timeout=60_000)
        assert not wait_until_no_workers(timeout=5.0)
        page.screenshot(path=str(ARTIFACTS / "notebook-after-stop.png"))


def test_elastic_jobs_panel_lists_a_background_job_and_stops_it(panel_lab, tmp_path):
    """The extension's side panel, status bar item and notification, over its comm."""
    with chromium_page() as page:
        open_notebook(page, panel_lab, 6)
        # %%elastic cells are highlighted as Python: `import` is coloured as a keyword.
        editor = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".cm-content")
        keyword = editor.locator("span", has_text=re.compile(r"^import$")).first
        color = "(el) => getComputedStyle(el).color"
        assert keyword.evaluate(color) != editor.locator(".cm-line").nth(1).evaluate(color)
        run_cell(page, 0)
        run_cell(page, 1)
        # --bg returns at once; the kernel is free while the job runs.
        expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
               ).to_have_count(1, timeout=60_000)
        page.locator("li[data-id='elastic-magic-jobs']").click()
        panel = page.locator("#elastic-magic-jobs")
        row = panel.locator(".em-panel-row").first
        expect(row).to_contain_text("running", timeout=90_000)
        expect(row).to_contain_text("world size 2")
        expect(row).to_contain_text("1 machine")
        expect(row).to_contain_text("restarts 0/0")
        status = page.locator("[data-em=status]")
        expect(status).to_contain_text("elastic #1: running")
        expect(status).to_be_visible()
        assert len(wait_for_workers(2)) == 2

        # Its cell, from the row's link: the notebook makes it the active cell.
        page.locator(".jp-Notebook .jp-Cell").nth(2).click()
        row.locator(".em-panel-cell").click()
        expect(page.locator(".jp-Notebook .jp-Cell").nth(1)).to_have_class(
            re.compile(r"jp-mod-active"))

        # Stacks, then a resize outside the bounds (refused, saying them) and within.
        row.locator(".em-panel-stacks").click()
        expect(row.locator(".em-panel-stack-text")).to_contain_text("time.sleep(600)",
                                                                     timeout=30_000)
        row.locator(".em-panel-nproc").fill("5")
        row.locator(".em-panel-resize").click()
        expect(row.locator(".em-panel-error")).to_contain_text("between 2 and 3 workers")
        row.locator(".em-panel-nproc").fill("3")
        row.locator(".em-panel-resize").click()
        page.locator(".jp-Notebook .jp-Cell").nth(2).click()  # leave the box: redraws
        expect(row).to_contain_text("world size 3", timeout=60_000)
        # The row's chart: the world size over time, the resize marked with its sentence.
        resized = row.locator(".em-panel-chart [data-em=chart][data-chart=world_size] "
                              "[data-em=mark][data-kind=resize]")
        expect(resized).not_to_have_count(0, timeout=30_000)
        assert "3 workers" in resized.first.get_attribute("title")
        panel.screenshot(path=str(ARTIFACTS / "elastic-jobs-panel.png"))

        # A page reload mid-training loses nothing: with the notebook saved since the cell
        # ran (as JupyterLab's autosave does), the widget manager restores the job's
        # dashboard from the kernel, live, and the panel lists the job again.
        page.keyboard.press("Control+s")
        expect(page.locator(".lm-TabBar-tab.jp-mod-dirty")).to_have_count(0, timeout=30_000)
        page.reload()
        expect(page.locator(".jp-Notebook .jp-Cell")).to_have_count(6, timeout=60_000)
        dash = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".em-dash")
        expect(dash.locator("[data-em=state]")).to_have_text("running", timeout=60_000)
        expect(dash.locator("[data-em=world-size]")).to_have_text("world size 3")
        expect(dash.locator("[data-em=lines]")).to_contain_text("background job up")
        expect(dash.locator("[data-em=chart][data-chart=world_size] [data-em=mark]"
                            "[data-kind=resize]")).not_to_have_count(0)
        dash.screenshot(path=str(ARTIFACTS / "dashboard-after-reload.png"))
        if not panel.is_visible():
            page.locator("li[data-id='elastic-magic-jobs']").click()
        row = panel.locator(".em-panel-row").first
        expect(row).to_contain_text("running", timeout=30_000)
        expect(row).to_contain_text("world size 3")

        row.locator(".em-panel-stop").click()
        expect(row).to_contain_text("stopped", timeout=60_000)
        expect(row.locator(".em-panel-stop")).to_have_count(0)
        toast = page.locator(".Toastify__toast", has_text="elastic job #1 stopped after")
        expect(toast).to_be_visible(timeout=30_000)
        expect(page.locator("[data-em=status]")).to_have_text("")
        assert not wait_until_no_workers(timeout=5.0)
        # The kernel's swap of the dashboard for the record was an update of a display
        # the reloaded page never saw: the extension put the record in its place.
        expect(page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".elastic-record")
               ).to_contain_text("stopped", timeout=30_000)
        page.screenshot(path=str(ARTIFACTS / "elastic-jobs-after-stop.png"))

        # A job that cannot resize shows no resize control; its failure's record reads
        # well in the light and the dark theme.
        run_cell(page, 3)
        cell = page.locator(".jp-Notebook .jp-Cell").nth(3)
        dash = cell.locator(".em-dash")
        expect(dash.locator("[data-em=state]")).to_have_text("running", timeout=90_000)
        expect(dash.locator("[data-em=scale]")).to_be_hidden()
        # The panel acts on a job whose cell is still running (its comm is not queued
        # behind the cell): its stacks, from the row of job #2.
        row = panel.locator(".em-panel-row", has_text="#2 job")
        expect(row).to_contain_text("running", timeout=30_000)
        expect(row.locator(".em-panel-resize")).to_have_count(0)  # it cannot resize
        row.locator(".em-panel-stacks").click()
        expect(row.locator(".em-panel-stack-text")).to_contain_text("time.sleep(0.1)",
                                                                     timeout=30_000)
        (tmp_path / "fail-now").touch()  # the kernel's working directory
        heading = cell.locator(".elastic-record b", has_text="Root cause: rank 0")
        expect(heading).to_be_visible(timeout=60_000)
        expect(cell.locator(".elastic-record")).to_contain_text("(attempt 1 of 1)")
        expect(cell.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
               ).to_contain_text("JobFailedError")
        traceback = cell.locator(".elastic-record pre").first
        assert heading.evaluate(CONTRAST) >= 3 and traceback.evaluate(CONTRAST) >= 4.5
        # The record's chart: the world size over the job, the failure marked on it with
        # its sentence on hover; its text in the theme's colour, in light and dark.
        chart = cell.locator(".elastic-record svg.elastic-charts")
        expect(chart.locator("[data-chart=world_size]")).to_have_count(1)
        mark = chart.locator(".elastic-mark[data-kind=failed] title")
        expect(mark).to_have_count(1)
        assert "rank 0 failed: " in mark.text_content()
        label = chart.locator("text").first
        assert label.evaluate(CONTRAST) >= 4.5
        chart.screenshot(path=str(ARTIFACTS / "record-chart-light.png"))
        use_theme(page, "JupyterLab Dark")
        dark = heading.evaluate(CONTRAST), traceback.evaluate(CONTRAST)
        cell.screenshot(path=str(ARTIFACTS / "record-dark.png"))
        assert dark[0] >= 3 and dark[1] >= 4.5, dark
        assert label.evaluate(CONTRAST) >= 4.5  # the chart's text follows the theme
        chart.screenshot(path=str(ARTIFACTS / "record-chart-dark.png"))

        # A page reloaded while a cell runs its job: JupyterLab asks the kernel for its
        # widgets and comms on the main shell, which the cell holds, so the job shows again
        # when it ends, and then as the cell's record, put where the lost display was.
        run_cell(page, 5)
        cell = page.locator(".jp-Notebook .jp-Cell").nth(5)
        expect(cell.locator(".em-dash [data-em=state]")).to_have_text("running",
                                                                      timeout=90_000)
        page.keyboard.press("Control+s")
        expect(page.locator(".lm-TabBar-tab.jp-mod-dirty")).to_have_count(0, timeout=30_000)
        page.reload()
        expect(page.locator(".jp-Notebook .jp-Cell").nth(5)).to_be_visible(timeout=60_000)
        if not panel.is_visible():
            page.locator("li[data-id='elastic-magic-jobs']").click()
        (tmp_path / "finish-now").touch()  # the kernel's working directory
        record = page.locator(".jp-Notebook .jp-Cell").nth(5).locator(".elastic-record")
        expect(record).to_contain_text("succeeded", timeout=60_000)
        expect(record).to_contain_text("waiting for finish-now")
        expect(panel.locator(".em-panel-row", has_text="#3 job")).to_contain_text("succeeded")
        page.keyboard.press("Control+s")  # the file keeps the record, not the widget
        expect(page.locator(".lm-TabBar-tab.jp-mod-dirty")).to_have_count(0, timeout=30_000)
        (saved,) = nbformat.read(tmp_path / "dashboard.ipynb", as_version=4).cells[5].outputs
        assert "elastic-record" in saved.data["text/html"], saved
        assert "application/vnd.jupyter.widget-view+json" not in saved.data, saved

        # The kernel's session is listed too, and its actions reach it.
        run_cell(page, 4)
        row = panel.locator(".em-panel-row", has_text="#4 session")
        expect(row).to_contain_text("idle", timeout=90_000)
        expect(row).to_contain_text("world size 2")
        expect(row).to_contain_text("0 cells run")
        expect(page.locator("[data-em=status]")).to_contain_text("elastic session #4: idle")
        row.locator(".em-panel-stacks").click()
        expect(row.locator(".em-panel-stack-text")).to_contain_text("==> rank 1 <==",
                                                                     timeout=30_000)
        panel.screenshot(path=str(ARTIFACTS / "elastic-jobs-panel-session.png"))
        row.locator(".em-panel-stop").click()
        expect(row.locator(".em-panel-stop")).to_have_count(0, timeout=60_000)
        expect(page.locator("[data-em=status]")).to_have_text("")
        assert not wait_until_no_workers(timeout=30.0)


# A step every half second: the dashboard keeps each rank's last 150 lines, so "step 0" stays
# in it for over a minute, however slowly a loaded machine restarts the kernel.
DETACHED_TRAINING = ("import time\nfor step in range(10**6):\n"
                     "    print(f'step {step}', flush=True)\n    time.sleep(0.5)")
DETACHED_CELLS = ["%load_ext elastic_magic", f"%%elastic --detach --nproc 2\n{DETACHED_TRAINING}"]


def last_step_shown(lines) -> int:
    return max(int(n) for n in re.findall(r"step (\d+)", lines.inner_text()))


def test_a_detached_training_is_attached_from_the_panel_after_a_kernel_restart(cache,
                                                                                tmp_path):
    """The kernel restarted under a --detach job: the panel lists the job as detached, its
    Attach runs `%elastic attach` in a new cell whose dashboard shows the story from before
    the restart and goes on live, the notebook opened again after the browser was closed
    shows it current and live, and the panel stops it leaving nothing."""
    require_extension()
    with jupyterlab(tmp_path, DETACHED_CELLS) as url, chromium_page() as page:
        open_notebook(page, url, 2)
        run_cell(page, 0)
        run_cell(page, 1)
        dash = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".em-dash")
        expect(dash.locator("[data-em=lines]")).to_contain_text("step 3", timeout=90_000)
        (connection,) = detached_folder.connections()
        run_id = connection.run_id

        # The notebook's kernel restarts, as after a %pip install: the job runs on.
        page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Restart Kernel")).first.click()
        page.locator(".jp-Dialog").get_by_role("button", name="Confirm Kernel Restart").click()
        expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
               ).to_have_count(1, timeout=60_000)
        assert len(wait_for_workers(2)) == 2
        run_cell(page, 0)  # the new kernel loads the extension: the panel hears it
        page.locator("li[data-id='elastic-magic-jobs']").click()
        panel = page.locator("#elastic-magic-jobs")
        row = panel.locator(f".em-panel-detached-row[data-em-job='{run_id}']")
        expect(row).to_contain_text("%%elastic --detach --nproc 2", timeout=60_000)
        expect(row).to_contain_text("running for")
        panel.screenshot(path=str(ARTIFACTS / "elastic-jobs-panel-detached.png"))

        # Attach: a new cell below the active one (cell 1) follows the job.
        cells = page.locator(".jp-Notebook .jp-Cell").count()
        row.locator(".em-panel-attach").click()
        expect(page.locator(".jp-Notebook .jp-Cell")).to_have_count(cells + 1, timeout=30_000)
        cell = page.locator(".jp-Notebook .jp-Cell").nth(2)
        expect(cell.locator(".cm-content")).to_have_text(f"%elastic attach {run_id}")
        dash = cell.locator(".em-dash")
        expect(dash.locator("[data-em=state]")).to_have_text("running", timeout=60_000)
        lines = dash.locator("[data-em=lines]")
        expect(lines).to_contain_text("step 0")  # from before this kernel was born
        seen = last_step_shown(lines)
        expect(lines).to_contain_text(f"step {seen + 3}", timeout=30_000)  # then live
        expect(row).to_have_count(0)  # followed here now: a job of the kernel's list
        job_row = panel.locator(f".em-panel-row[data-em-job='{run_id}']")
        expect(job_row).to_contain_text("running", timeout=30_000)

        # The browser closed mid-training, and the notebook opened again a while later:
        # the attaching cell's dashboard is current (what ran meanwhile), then live.
        page.keyboard.press("Control+s")
        expect(page.locator(".lm-TabBar-tab.jp-mod-dirty")).to_have_count(0, timeout=30_000)
        closed_at = last_step_shown(lines)
        context = page.context
        page.close()
        time.sleep(6)  # 12 steps run with no page open
        page = context.new_page()
        page.goto(url)
        dash = page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".em-dash")
        expect(dash.locator("[data-em=state]")).to_have_text("running", timeout=60_000)
        lines = dash.locator("[data-em=lines]")
        expect(lines).to_contain_text(f"step {closed_at + 10}", timeout=30_000)
        seen = last_step_shown(lines)
        expect(lines).to_contain_text(f"step {seen + 3}", timeout=30_000)
        dash.screenshot(path=str(ARTIFACTS / "dashboard-detached-after-reload.png"))

        panel = page.locator("#elastic-magic-jobs")
        if not panel.is_visible():
            page.locator("li[data-id='elastic-magic-jobs']").click()
        job_row = panel.locator(f".em-panel-row[data-em-job='{run_id}']")
        job_row.locator(".em-panel-stop").click()
        expect(job_row).to_contain_text("stopped", timeout=60_000)
        expect(page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".elastic-record")
               ).to_contain_text("stopped", timeout=30_000)
        assert not wait_until_no_workers(timeout=30.0)
        deadline = time.monotonic() + 30  # the agent gave its result and left nothing
        while list(detached_folder.runtime_folder().glob("em-*")) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        assert not list(detached_folder.runtime_folder().glob("em-*"))

        # A detached job that another kernel (here, this test) starts and ends while the
        # kernel is idle: the open panel's own looks list it, then drop it.
        spec = JobSpec.create(1, detach=True)
        other = detached_launch.start(spec, build_payload(DETACHED_TRAINING, spec))
        try:
            other.detach()
            row = panel.locator(f".em-panel-detached-row[data-em-job='{other.run_id}']")
            expect(row).to_have_count(1, timeout=30_000)
            again = attach(other.run_id)
            again.stop()
            again.wait_done(timeout=60)
            expect(row).to_have_count(0, timeout=30_000)
        finally:
            detached_launch.drop_standby()


@pytest.mark.parametrize("network", [2], indirect=True)
def test_elastic_jobs_panel_shows_slurm_allocations_with_the_schedulers_reason(
        network, tmp_path, monkeypatch):
    """A --launcher slurm job on a real two-node Slurm (tests/slurm.py) asks for three
    machines: the panel lists the two running and the one pending with squeue's reason, and
    its Stop leaves nothing in the queue."""
    from test_slurm import options, slurm_cluster

    require_extension()
    with slurm_cluster(network, tmp_path, monkeypatch) as slurm:
        launch = " ".join(f"--launch {k}={v}" for k, v in options(tmp_path).items())
        cells = ["%load_ext elastic_magic",
                 f"%%elastic --bg --nproc 1 --nnodes 1:4 --rdzv-endpoint "
                 f"{network.head_address} --launcher slurm {launch}\n"
                 "import time\ntime.sleep(600)"]
        with jupyterlab(tmp_path, cells) as url, chromium_page() as page:
            open_notebook(page, url, 2)
            run_cell(page, 0)
            run_cell(page, 1)
            page.locator("li[data-id='elastic-magic-jobs']").click()
            row = page.locator("#elastic-magic-jobs .em-panel-row").first
            # the first lines are the kernel's own "pending" (submitted, not yet listed)
            expect(row.locator(".em-alloc-running")).to_have_count(2, timeout=120_000)
            pending = row.locator(".em-alloc-pending")
            expect(pending).to_have_text(re.compile(r"^\d+: pending \(Resources\)$"),
                                         timeout=60_000)
            expect(row).to_contain_text("3 machines", timeout=120_000)
            assert len(slurm.queue()) == 3, slurm.queue()
            # The cell's dashboard draws each machine's ranks as a band up to the world
            # size, named in its legend: the head, and each other by its allocation.
            dash = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".em-dash")
            world = dash.locator("[data-em=chart][data-chart=world_size]")
            labels = world.locator(".u-legend .u-series .u-label")
            expect(labels).to_have_count(5, timeout=60_000)  # time, 3 machines, world size
            named = labels.all_inner_texts()[1:]
            head = f"{network.head_address} (head)"
            others = [n for n in named[:-1] if n != head]
            assert named[-1] == "world size" and head in named, named
            assert len(others) == 2, named
            assert all(re.fullmatch(r"\S+ \(\d+\)", n) for n in others), named
            world.screenshot(path=str(ARTIFACTS / "dashboard-machines-chart.png"))
            page.locator("#elastic-magic-jobs").screenshot(
                path=str(ARTIFACTS / "elastic-jobs-panel-slurm.png"))
            row.locator(".em-panel-stop").click()
            expect(row).to_contain_text("stopped", timeout=60_000)
            expect(row.locator(".em-panel-machines")).to_have_count(0)
            deadline = time.monotonic() + 60
            while slurm.queue() and time.monotonic() < deadline:
                time.sleep(0.5)
            assert slurm.queue() == []
