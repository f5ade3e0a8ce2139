"""The charts' series and the record's SVG, from events recorded from a real job (a rank
fails, the group restarts) and from commits and logged scalars: what is drawn, where, and
the sentence each mark says on hover. No process is started."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from recorded_jobs import restart_job

from elastic_magic.result import JobState, RankFailure
from elastic_magic.ui import charts as charts_module
from elastic_magic.ui.chart_svg import charts_svg
from elastic_magic.ui.charts import MARK_COLORS, Charts
from elastic_magic.ui.dashboard import widget_module
from elastic_magic.ui.dashboard_state import DashboardState
from elastic_magic.ui.record import record_bundle, record_html, record_text
from elastic_magic.wire.events import (
    Committed,
    MembershipChanged,
    RendezvousCompleted,
    Restarting,
    StateChanged,
)
from elastic_magic.wire.metrics import Logged

pytestmark = pytest.mark.unit
SVG = "{http://www.w3.org/2000/svg}"
ROOT = Path(__file__).resolve().parents[1]


def restarted(tmp_path) -> DashboardState:
    recorded = restart_job(tmp_path)
    state = DashboardState(recorded.run_id, str(recorded.log_dir), recorded.max_restarts)
    for event in recorded.events:
        state.apply(event)
    return state


def test_the_world_size_drops_while_a_group_is_down_and_holds_to_the_end(tmp_path):
    state = restarted(tmp_path)
    sizes = [(size, machines) for _, size, machines in state.charts.sizes]
    assert sizes == [(2, 1), (0, 0), (2, 1), (2, 1)]  # formed, failed, formed again, end
    times = [t for t, _, _ in state.charts.sizes]
    assert times == sorted(times)


def test_the_record_draws_the_size_and_marks_the_failure_and_the_restart(tmp_path):
    state = restarted(tmp_path)
    t0 = state.charts.sizes[0][0]
    for i, step in enumerate((10, 20, 40)):  # commits 1 s apart: 10, then 20 steps/s
        state.apply(Committed(step=step, world_size=2, nbytes=8, time=t0 + i,
                              samples=12 * step))  # an ElasticSampler's: 12 a step
    state.apply(Logged(0, tuple((t0 + s, s, "loss", 1.0 / s) for s in range(1, 51))))
    state.apply(Logged(1, ((t0, 1, "loss", 2.0), (t0 + 1, 2, "loss", 1.5))))
    svg = ET.fromstring(charts_svg(state.charts, state.timeline))
    panels = {g.get("data-chart"): g for g in svg.iter(f"{SVG}g")
              if g.get("class") == "elastic-chart"}
    assert list(panels) == ["world_size", "steps_per_second", "samples_per_second", "loss"]
    marks = [(g.get("data-kind"), g.find(f"{SVG}title").text)
             for g in panels["world_size"].iter(f"{SVG}g") if g.get("class") == "elastic-mark"]
    assert [kind for kind, _ in marks] == ["failed", "restart"]
    assert marks[0][1].endswith(" rank 1 failed: ValueError: first attempt breaks (cell line "
                                "10)")
    assert "restarting the group (1/1) after rank 1" in marks[1][1]
    size_line = panels["world_size"].find(f"{SVG}path[@stroke='#1f77b4']")
    assert re.fullmatch(r"M[\d.]+,[\d.]+( H[\d.]+ V[\d.]+){3}", size_line.get("d"))
    rates = panels["steps_per_second"].find(f"{SVG}polyline")
    assert len(rates.get("points").split()) == 2
    assert "steps/s: 20 at the end" in rates.find(f"{SVG}title").text
    samples = panels["samples_per_second"].find(f"{SVG}polyline")
    assert "samples/s: 240 at the end" in samples.find(f"{SVG}title").text
    lines = panels["loss"].findall(f"{SVG}polyline")
    assert [len(p.get("points").split()) for p in lines] == [50, 2]  # one a rank
    assert lines[0].find(f"{SVG}title").text == "loss (rank 0): 0.02 at step 50"
    assert 'fill="currentColor"' in ET.tostring(svg, encoding="unicode")  # the theme's text
    html = record_html(state)
    assert "<summary>Charts</summary>" in html and "<svg" in html
    assert "logged loss: 1.5 at step 2 (rank 1)" in record_text(state)


def test_no_chart_without_a_story_and_a_long_run_keeps_its_shape(monkeypatch):
    charts = Charts()
    assert charts.empty and charts_svg(charts, []) == ""
    monkeypatch.setattr(charts_module, "CHART_POINTS", 100)
    charts = Charts()
    charts.apply(Logged(0, tuple((float(s), s, "x", float(s)) for s in range(1000))))
    kept = [step for step, _, _ in charts.metrics["x"]]
    assert len(kept) <= 101 and kept[0] == 0 and kept[-1] == 999 and kept == sorted(kept)
    # a diverged value (nan, inf) is left out of the chart, not the whole line
    charts.apply(Logged(0, ((0.0, 1000, "x", float("nan")), (0.0, 1001, "x", float("inf")),
                            (0.0, 1002, "x", 5.0))))
    assert charts.metrics["x"][-1] == (1002, 5.0, 0)
    assert "nan" not in charts_svg(charts, []) and "inf" not in charts_svg(charts, [])
    charts.apply(Logged(0, ((0.0, 1003, "x", float("nan")),)))
    state = DashboardState("em-x", "/tmp/logs", 0)
    state.charts = charts
    assert "logged x: nan at step 1003 (rank 0)" in record_text(state)  # said, not hidden
    two_commits = Charts()  # a rate needs two: one commit draws nothing
    two_commits.apply(Committed(step=1, world_size=1, nbytes=1, time=1.0))
    two_commits.apply(Committed(step=2, world_size=1, nbytes=1, time=2.0))
    assert two_commits.empty and charts_svg(two_commits, []) == ""


def test_the_live_charts_get_the_same_story_small_and_json_ready(tmp_path):
    """What the widget and the panel draw (Charts.live): the sizes, rates and marks of the
    record, each rank's scalars thinned on their own to at most ``points`` with the first
    and the last kept, numbers short; the panel's asks for no scalars."""
    state = restarted(tmp_path)
    t0 = state.charts.sizes[0][0]
    for i, step in enumerate((10, 20, 40)):
        state.apply(Committed(step=step, world_size=2, nbytes=8, time=t0 + i))
    state.apply(Logged(0, tuple((t0 + s, s, "loss", 1.0 / 3 / s) for s in range(1, 1001))))
    state.apply(Logged(1, ((t0, 1, "loss", 2.0), (t0 + 1, 2, "loss", 1.5))))
    live = state.charts.live(state.timeline, final=True, points=50)
    assert json.loads(json.dumps(live)) == live
    assert [row[1:] for row in live["sizes"]] == [[2, 1], [0, 0], [2, 1], [2, 1]]
    assert [rate for _, rate in live["rates"]] == [10.0, 20.0]
    assert live["samples"] == []  # these commits had no ElasticSampler to count
    assert [label for _, label, _ in live["marks"]] == ["failed", "restart"]
    assert "rank 1 failed: ValueError" in live["marks"][0][2]
    rank0 = [p for p in live["metrics"]["loss"] if p[2] == 0]
    assert len(rank0) == 50 and rank0[0][0] == 1 and rank0[-1][0] == 1000
    assert rank0[0][1] == 0.333333  # six digits
    assert [p[:2] for p in live["metrics"]["loss"] if p[2] == 1] == [[1, 2.0], [2, 1.5]]
    assert live["colors"]["marks"]["failed"] == MARK_COLORS["failed"]  # the record's palette
    panel = state.charts.live(state.timeline, final=False, metrics=False, points=2)
    assert panel["metrics"] == {} and not panel["final"]
    assert [row[1:] for row in panel["sizes"]] == [[2, 1], [2, 1]]  # first and last


def test_several_machines_are_drawn_as_bands_of_their_ranks_up_to_the_world_size():
    """A job of several machines: each machine's ranks in every group (0 where it was not in
    it), in the order the machines came, in the live charts and as stacked bands in the
    record, each band named on hover; a job of one machine draws no band."""
    head, second, third = "10.0.0.1 (head)", "10.0.0.2 (pid 41)", "10.0.0.3 (job 7)"
    charts = Charts()
    for event in (
            RendezvousCompleted(1, 0, 2, 3, "10.0.0.1", 1, ((head, 2), (second, 1)), time=10.0),
            MembershipChanged(3, 5, time=20.0),
            RendezvousCompleted(2, 0, 3, 5, "10.0.0.1", 1,
                                ((third, 2), (head, 2), (second, 1)), time=21.0),
            Restarting(1, 3, RankFailure(rank=1, local_rank=1, attempt=2, pid=1, time=30.0,
                                      signal="SIGKILL"), time=30.0),
            RendezvousCompleted(3, 0, 2, 4, "10.0.0.1", 1, ((head, 2), (third, 2)), time=31.0),
            StateChanged(JobState.SUCCEEDED, time=40.0)):
        charts.apply(event)
    names, split = charts.by_machine
    assert names == [head, second, third]
    assert split == [(10.0, [2, 1, 0]), (20.0, [0, 0, 0]), (21.0, [2, 1, 2]),
                     (30.0, [0, 0, 0]), (31.0, [2, 0, 2]), (40.0, [2, 0, 2])]
    live = charts.live([], final=True)
    assert live["machines"] == names
    assert [row[1:] for row in live["by_machine"]] == [ranks for _, ranks in split]
    svg = ET.fromstring(charts_svg(charts, []))
    bands = [path.find(f"{SVG}title").text for path in svg.iter(f"{SVG}path")
             if path.get("class") == "elastic-machine"]
    assert bands == [f"{head}: 2 ranks at the end", f"{second}: 0 ranks at the end",
                     f"{third}: 2 ranks at the end"]
    (legend,) = [t for t in svg.iter(f"{SVG}text") if t.get("class") == "elastic-legend"]
    assert "".join(legend.itertext()).split("■")[1:] == [f" {head}  ", f" {second}  ",
                                                          f" {third}"]
    many = Charts()  # a legend fits one line: the rest are counted (each band says its name)
    many.apply(RendezvousCompleted(1, 0, 9, 9, "h", 1, tuple((f"10.0.0.{i} (pid 4{i})", 1)
                                                            for i in range(9)), time=1.0))
    many.apply(StateChanged(JobState.SUCCEEDED, time=2.0))
    legend_text = "".join(next(t for t in ET.fromstring(charts_svg(many, [])).iter(f"{SVG}text")
                               if t.get("class") == "elastic-legend").itertext())
    assert legend_text.count("■") == 2 and legend_text.endswith("and 7 more"), legend_text
    alone = Charts()
    alone.apply(RendezvousCompleted(1, 0, 1, 2, "127.0.0.1", 1, (("127.0.0.1 (pid 9)", 2),)))
    alone.apply(StateChanged(JobState.SUCCEEDED))
    assert alone.by_machine == ([], []) and "elastic-machine" not in charts_svg(alone, [])


def test_the_widget_module_holds_upLot_the_shared_charts_and_the_dashboard():
    """The widget's one module: the vendored uPlot is the version the extension bundles,
    liveCharts is defined once and not exported (a module exports only the widget)."""
    module = widget_module()
    package = json.loads((ROOT / "labextension" / "package.json").read_text())
    version = package["dependencies"]["uplot"].lstrip("^~")
    assert module.startswith(f"/*! https://github.com/leeoniya/uPlot (v{version}) */")
    assert module.count("function liveCharts(") == 1
    assert re.findall(r"^export .*", module, re.MULTILINE) == ["export default { render };"]


def test_an_html_export_keeps_the_records_chart(tmp_path):
    """What nbviewer and `jupyter nbconvert --to html` show of a saved record: the chart's
    SVG, its marks' sentences among it, with no script needed."""
    import nbformat
    from nbconvert import HTMLExporter

    state = restarted(tmp_path)
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("%%elastic --nproc 2 --max-restarts 1\n...")
    cell.outputs = [nbformat.v4.new_output("display_data", data=record_bundle(state))]
    nb.cells = [cell]
    html, _ = HTMLExporter().from_notebook_node(nb)
    assert html.count('<svg class="elastic-charts"') == 1
    assert 'data-chart="world_size"' in html
    assert "rank 1 failed: ValueError: first attempt breaks" in html
