"""The benchmark harness reads what the jobs it times print and show: read wrongly, a side
that worked counts as a hang (nan). Checked here on what the product and torchrun really
produce, as the harness never runs in the suite."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from elastic_magic.agent.machines.token_file import TokenFile
from elastic_magic.wire.events import Output

ROOT = str(Path(__file__).resolve().parents[1])  # the benchmarks package's folder
if ROOT not in sys.path:  # (an editable install puts it there already)
    sys.path.append(ROOT)
from benchmarks.common import ready_stamps, ready_times  # noqa: E402
from benchmarks.join import join_command_parts  # noqa: E402

pytestmark = pytest.mark.unit


def test_ready_marks_are_found_in_lines_that_ranks_sharing_a_pipe_interleaved():
    # torchrun's 3 workers on one stdout, under python -u: print writes the text and the
    # newline apart
    lines = ["READY 1795961634.860557 3READY 1795961634.8605714 3\n", "\n",
             "READY 1795961634.860945 3\n"]
    assert [s for line in lines for s in ready_stamps(line, 3)] == [
        1795961634.860557, 1795961634.8605714, 1795961634.860945]
    assert ready_stamps("READY 1795961634.5 2\n", 3) == []  # the old world's


def test_ready_marks_are_read_from_a_jobs_output_events():
    events = [Output(0, "stdout", ("step 1", "READY 12.5 2"), attempt=0),
              Output(1, "stdout", ("READY 12.75 2",), attempt=0)]
    assert ready_times(events, 2) == [12.5, 12.75]
    assert ready_times(events, 3) == []


def test_the_join_command_a_head_shows_gives_its_endpoint_and_token_file(tmp_path):
    folder = tmp_path / "tokens"
    folder.mkdir(mode=0o700)
    token_file = TokenFile("run-1", "s3cret", folder)
    endpoint, path = join_command_parts(token_file.command("10.0.0.1:29400"))
    assert endpoint == "10.0.0.1:29400"
    assert Path(path).read_text() == "s3cret"
    with pytest.raises(ValueError, match="not a join command"):
        join_command_parts("ELASTIC_MAGIC_TOKEN=x elastic-magic join 10.0.0.1:29400")
