"""Shared fixtures. Every worker our tests start inherits a tag, so a leftover process from
this run (and only from this run) can be found in the process table."""

from __future__ import annotations

import os
import time
import uuid

import psutil
import pytest

TAG = f"em-test-{uuid.uuid4().hex[:10]}"
os.environ["ELASTIC_MAGIC_TEST_TAG"] = TAG  # inherited by workers and by test kernels


def tagged_workers() -> list[psutil.Process]:
    """Live worker processes started by this test run."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            if "elastic_magic.worker" in cmdline and proc.environ().get(
                "ELASTIC_MAGIC_TEST_TAG"
            ) == TAG and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_until_no_workers(timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := tagged_workers()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(autouse=True)
def no_leftover_workers():
    """After every test the process table holds no worker of ours."""
    yield
    left = wait_until_no_workers(timeout=3.0)
    for proc in left:  # ours by tag; end them so one leak does not cascade
        proc.kill()
    assert not left, f"worker processes left behind: {[p.pid for p in left]}"


@pytest.fixture
def log_dir(tmp_path):
    path = tmp_path / "logs"
    path.mkdir()
    return path


class Recorder:
    """A renderer that keeps every event, for assertions."""

    def __init__(self) -> None:
        self.events: list = []

    def __call__(self, events: list) -> None:
        self.events.extend(events)

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def lines(self, rank: int, stream: str = "stdout") -> list[str]:
        from elastic_magic.events import Output

        return [
            line for e in self.of(Output) if e.rank == rank and e.stream == stream
            for line in e.lines
        ]


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def ip():
    """The real IPython shell (globalipapp) with the extension loaded."""
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "elastic_magic")
    yield shell
    shell.run_line_magic("unload_ext", "elastic_magic")
