"""``elastic_magic.log``: scalars a cell logs reach the job's result (``result.metrics``) and
its events (the dashboard's charts): rank 0's by default, any rank's on request, every point
of a fast loop, each session cell its own."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy
import pytest
import readme
import torch

import elastic_magic as em
from elastic_magic.training import log as metrics_log
from elastic_magic.wire import metrics
from elastic_magic.wire.metrics import Logged, MetricsKept


@pytest.fixture
def rank(monkeypatch):
    def be(rank: int) -> None:
        monkeypatch.setenv("RANK", str(rank))
    metrics_log.reset()
    be(0)
    yield be
    metrics_log.reset()


def points(logged: Logged | None) -> list[tuple[int, str, float]]:
    assert logged is not None
    return [(step, name, value) for _, step, name, value in logged.points]


@pytest.mark.unit
def test_a_rank_keeps_what_it_logs_until_the_next_report(rank):
    em.log(loss=torch.tensor(0.5), lr=numpy.float32(0.25))
    em.log(loss=1)
    em.log(7, loss=2.0, rank="all")
    assert points(metrics_log.take()) == [(1, "loss", 0.5), (1, "lr", 0.25), (2, "loss", 1.0),
                                         (7, "loss", 2.0)]
    assert metrics_log.take() is None  # taken
    rank(1)
    em.log(loss=3.0)  # rank 0's by default: nothing here
    em.log(loss=4.0, rank=1)
    em.log(loss=5.0, rank="all")
    assert points(metrics_log.take()) == [(4, "loss", 4.0), (5, "loss", 5.0)]
    rank(0)  # another rank's call is not even read (no .item() wait on its GPU)
    with pytest.raises(TypeError, match=r"log\(loss=\.\.\.\): a number, not str"):
        em.log(loss="high")
    with pytest.raises(TypeError, match="a number, not bool"):
        em.log(done=True)
    with pytest.raises(TypeError, match="a number, not Tensor"):
        em.log(weights=torch.ones(3))
    with pytest.raises(ValueError, match="give a rank's number or 'all'"):
        em.log(loss=1.0, rank="rank 0")


@pytest.mark.unit
def test_the_step_is_the_states_and_a_flood_is_thinned(rank, monkeypatch):
    state = em.State(step=40)
    em.log(loss=1.0)
    state.step += 1
    em.log(loss=2.0)
    assert [step for step, _, _ in points(metrics_log.take())] == [40, 41]
    monkeypatch.setattr(metrics_log, "MAX_BUFFERED", 10)
    metrics_log.reset()
    for i in range(25):
        em.log(i, x=float(i), y=-float(i))
    kept = points(metrics_log.take())
    steps = [step for step, name, _ in kept if name == "x"]
    assert steps == [step for step, name, _ in kept if name == "y"]  # whole calls thinned
    assert len(steps) <= 11 and steps[0] == 0 and steps[-1] == 24 and steps == sorted(steps)


@pytest.mark.unit
def test_a_job_keeps_its_series_thinned_past_its_bound_and_a_cell_takes_its_own(monkeypatch):
    kept, seen = MetricsKept(), []
    sink = kept.tap(seen.append)
    sink(Logged(1, ((10.0, 1, "loss", 0.5), (10.0, 1, "lr", 0.1))))
    sink(Logged(0, ((11.0, 2, "loss", 0.4),)))
    assert len(seen) == 2  # passed on
    series = kept.take()
    assert (series["loss"].steps, series["loss"].values, series["loss"].ranks,
            series["loss"].times) == ([1, 2], [0.5, 0.4], [1, 0], [10.0, 11.0])
    assert kept.take() == {}  # a session's next cell starts empty
    monkeypatch.setattr(metrics, "MAX_POINTS", 8)
    for step in range(100):
        kept.add(Logged(0, ((float(step), step, "x", float(step)),)))
    steps = kept.take()["x"].steps
    assert len(steps) <= 9 and steps[0] == 0 and steps[-1] == 99 and steps == sorted(steps)
    gaps = {b - a for a, b in itertools.pairwise(steps[:-1])}  # the latest: kept anyway
    assert len(gaps) == 1, steps  # evenly over the run, not thinned at its start only
    for step in range(100):  # two ranks in turn: each thinned apart, neither crowded out
        for r in (0, 1):
            kept.add(Logged(r, ((float(step), step, "y", float(r)),)))
    y = kept.take()["y"]
    assert y.ranks.count(0) == y.ranks.count(1) > 4 and y.steps[-2:] == [99, 99]
    result = em.JobResult("em-x", em.JobState.SUCCEEDED, 1, 0, 0, 0.0, Path("logs"),
                          metrics=series)
    frame = result.metrics_frame()
    assert list(frame.columns) == ["name", "rank", "step", "value", "time"]
    assert frame.values.tolist() == [["loss", 1, 1, 0.5, 10.0], ["loss", 0, 2, 0.4, 11.0],
                                     ["lr", 1, 1, 0.1, 10.0]]
    monkeypatch.setitem(sys.modules, "pandas", None)  # a kernel without pandas
    with pytest.raises(ImportError, match=r"needs pandas \(pip install pandas\)"):
        result.metrics_frame()


TRAIN = """\
import elastic_magic, torch
state = elastic_magic.State(step=0)
while state.step < 300:
    state.step += 1
    elastic_magic.log(loss=1.0 / state.step)
    elastic_magic.log(seen=float(state.step), rank="all")
    if state.step % 100 == 0:
        state.commit()
state.step
"""


def test_every_point_of_a_fast_loop_reaches_the_result_and_the_events(log_dir, recorder):
    """300 steps logged as fast as the loop goes (two scalars a step): every point, in
    order, rank 0's alone unless asked; the events carry them as they come."""
    result = em.launch(TRAIN, nproc=2, log_dir=log_dir, render=recorder)
    assert result.ok, result
    loss, seen = result.metrics["loss"], result.metrics["seen"]
    assert loss.steps == list(range(1, 301)) and set(loss.ranks) == {0}
    assert loss.values == pytest.approx([1.0 / s for s in range(1, 301)])
    for r in (0, 1):
        assert [s for s, k in zip(seen.steps, seen.ranks, strict=True) if k == r] == \
            list(range(1, 301))
    told = recorder.of(Logged)
    assert sum(len(e.points) for e in told) == 900
    with em.Session(nproc=2, log_dir=log_dir) as s:
        first = s.run("import elastic_magic\nfor i in range(3):\n"
                      "    elastic_magic.log(i, x=float(i))")
        second = s.run("elastic_magic.log(y=1.0, rank='all')")
    assert (first.metrics["x"].steps, list(first.metrics)) == ([0, 1, 2], ["x"])
    assert (sorted(second.metrics["y"].ranks), list(second.metrics)) == ([0, 1], ["y"])


def test_the_readme_example_logs_every_step(ip):
    (cell,) = readme.cells("%%elastic --nproc 2 -o run")
    outcome = ip.run_cell(cell.replace("%%elastic --nproc 2", "%%elastic --nproc 2 --text", 1))
    assert outcome.success, outcome.error_in_exec
    run = ip.user_ns["run"]
    assert run.metrics["loss"].steps == list(range(1, 101))
    assert set(run.metrics["lr"].values) == {0.01}
    assert sorted(run.metrics["seen"].ranks) == [0] * 100 + [1] * 100
