"""%%elastic in a real IPython shell (globalipapp), with real workers."""

from __future__ import annotations

import pytest
from conftest import tagged_workers
from IPython.core.error import UsageError

import elastic_magic as em
from elastic_magic.spec import OPTIONS


def test_cell_uses_kernel_globals_and_returns_job(ip, log_dir, capsys):
    ip.run_cell("SCALE = 3\ndef times_scale(v):\n    return v * SCALE\n")
    result = ip.run_cell_magic(
        "elastic", f"--nproc 2 -o job --pull weights --log-dir {log_dir}",
        "import torch.distributed as dist\n"
        "weights = [dist.get_rank()] * 2\n"
        "print('rank', dist.get_rank(), 'says hi')\n"
        "times_scale(dist.get_rank() + 1)\n",
    )
    out = capsys.readouterr().out
    assert "[rank 0] rank 0 says hi" in out and "[rank 1] rank 1 says hi" in out
    assert "[elastic] succeeded, world size 2" in out
    assert isinstance(result, em.JobResult) and result.values == {0: 3, 1: 6}
    assert ip.user_ns["job"] is result
    assert ip.user_ns["weights"] == [0, 0]


def test_cell_without_value_displays_nothing(ip, log_dir):
    assert ip.run_cell_magic("elastic", f"--nproc 1 --log-dir {log_dir}", "x = 1\n") is None


def test_failure_raises_with_root_cause_and_keeps_result(ip, log_dir):
    with pytest.raises(em.JobFailedError) as err:
        ip.run_cell_magic("elastic", f"--nproc 2 -o failed --log-dir {log_dir}",
                          "import torch.distributed as dist\n"
                          "assert dist.get_rank() == 0, 'rank 1 bad'\n")
    text = str(err.value)
    assert "Rank 1 failed first" in text and "AssertionError: rank 1 bad" in text
    assert ip.user_ns["failed"].failure.rank == 1
    assert err.value._render_traceback_()[0].startswith("JobFailedError: Rank 1 failed first")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("line", "cell", "fragment"),
    [
        ("--nproc zero", "x = 1", "whole number"),
        ("--nproc 0", "x = 1", "at least 1"),
        ("--backend nccl", "x = 1", "use gloo"),
        ("--backend mpi", "x = 1", "choose one of"),
        ("--max-restarts -1", "x = 1", "between 0 and"),
        ("--nnodes 0", "x = 1", "1 <= MIN <= MAX"),
        ("--nnodes 3:2", "x = 1", "1 <= MIN <= MAX"),
        ("--nnodes two", "x = 1", "expected N or MIN:MAX"),
        ("--rdzv-endpoint 127.0.0.1:29400", "x = 1", "add --nnodes MIN:MAX"),
        ("--nnodes 1:2 --rdzv-endpoint 127.0.0.1:99999", "x = 1", "HOST or HOST:PORT"),
        ("--nnodes 1:2 --rdzv-endpoint 192.0.2.1", "x = 1", "Give an address of this machine"),
        ("--env NOVALUE", "x = 1", "KEY=VALUE"),
        ("--args '--unclosed", "x = 1", "check the quotes"),
        ("--pull 'a-b'", "x = 1", "not a Python variable name"),
        ("-o 1x", "x = 1", "not a Python variable name"),
        ("--frobnicate", "x = 1", "unrecognized arguments"),
        ("--nproc 1", "   ", "empty"),
        ("--nproc 1", "%time x = 1", "IPython syntax"),
        ("--nproc 1", "!ls", "IPython syntax"),
        ("--nproc 1", "for i in range(3)\n    pass", "SyntaxError at cell line 1"),
        ("--nproc 1", "print(a_lock)", r"a_lock \(lock\): TypeError"),
    ],
)
def test_bad_input_is_a_usage_error_and_starts_nothing(ip, log_dir, line, cell, fragment):
    ip.run_cell("import threading\na_lock = threading.Lock()")
    with pytest.raises(UsageError, match=fragment):
        ip.run_cell_magic("elastic", f"{line} --log-dir {log_dir}", cell)
    assert list(log_dir.iterdir()) == [], "no job may have started"
    assert not tagged_workers()


def test_missing_pull_is_reported(ip, log_dir):
    with pytest.raises(UsageError, match="no variable named ghost"):
        ip.run_cell_magic("elastic", f"--nproc 1 --pull ghost --log-dir {log_dir}", "y = 2\n")


@pytest.mark.unit
def test_help_lists_every_flag(ip):
    doc = ip.find_cell_magic("elastic").__doc__
    python_only = {"gpus"}  # detected on each machine; only Python callers may state it
    for option in OPTIONS:
        if option.name not in python_only:
            assert option.flag, f"job option {option.name!r} has no %%elastic flag"
            assert f" {option.flag} " in doc, f"{option.flag} missing from %%elastic?"
    for flag in ("-o", "--out", "--bg", "--text"):
        assert f" {flag} " in doc
    ip.run_cell("%%elastic?")  # the help page itself renders without error


class _Reached(BaseException):
    """The cell got to its wait loop: the counting run ends there."""


def _line_events(package: str, stop_at: int | None):
    """A tracer for the main thread that numbers every line run in ``package`` and raises
    KeyboardInterrupt at line number ``stop_at`` (a Ctrl-C at that very point), or
    ``_Reached`` once the job's wait loop renders its first batch."""
    seen: list[tuple[str, str, int]] = []

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.startswith(package):
            return None
        if event == "call" and frame.f_code.co_name == "_render_batch":
            raise _Reached
        if event == "line":
            seen.append((frame.f_code.co_filename, frame.f_code.co_name, frame.f_lineno))
            if len(seen) == stop_at:
                raise KeyboardInterrupt
        return tracer

    return tracer, seen


@pytest.mark.unit
def test_an_interrupt_anywhere_in_a_cells_start_leaves_no_job_running(ip, log_dir):
    """Ctrl-C can land on any line between the magic's start and its wait for the job (a
    dashboard being built, the job being registered): the job is stopped either way."""
    import sys
    from pathlib import Path

    package = str(Path(em.__file__).parent)
    line, cell = f"--nproc 2 --text --log-dir {log_dir}", "import time\ntime.sleep(120)\n"
    magics = ip.magics_manager.registry["ElasticMagics"]

    def run(stop_at):
        tracer, seen = _line_events(package, stop_at)
        sys.settrace(tracer)
        try:
            ip.run_cell_magic("elastic", line, cell)
        except (_Reached, KeyboardInterrupt) as exc:
            outcome = type(exc)
        finally:
            sys.settrace(None)
        return outcome, seen

    outcome, lines = run(stop_at=None)  # count the lines, then stop the job it started
    assert outcome is _Reached
    started_at = next(i for i, (_, name, _) in enumerate(lines, 1) if name == "start")
    assert 0 < started_at < len(lines)
    points = sorted({*range(1, started_at, max(1, started_at // 8)),
                     *range(started_at, len(lines) + 1)})
    assert len(points) >= 10
    for point in points:
        outcome, _ = run(stop_at=point)
        assert outcome is KeyboardInterrupt, f"line {point}: {lines[point - 1]}"
        assert all(job.done for job in magics.jobs.values()), f"line {point} orphaned a job"
        assert not tagged_workers(), f"line {point}: {lines[point - 1]} left workers"


def test_unload_stops_background_jobs_and_removes_both_magics(log_dir):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "elastic_magic")
    job = shell.run_cell_magic("elastic", f"--nproc 1 --bg --text --log-dir {log_dir}",
                               "import time\ntime.sleep(120)\n")
    assert job.wait_for_running(timeout=60) or job.done
    shell.run_line_magic("unload_ext", "elastic_magic")
    assert job.done and job.state is em.JobState.STOPPED
    assert "elastic" not in shell.magics_manager.magics["cell"]
    assert "elastic" not in shell.magics_manager.magics["line"]
    assert not tagged_workers()
    shell.run_line_magic("load_ext", "elastic_magic")  # and it loads again
    assert "elastic" in shell.magics_manager.magics["line"]

@pytest.mark.unit
@pytest.mark.parametrize(("line", "words", "refs"), [
    ("session start --nproc 2     # the job flags", ["session", "start", "--nproc", "2"],
     True),
    ("# all of it", [], True),
    ("--env X=a#b --args '# not a comment' \"#x\"", ["--env", "X=a#b", "--args",
                                                     "# not a comment", "#x"], False),
    ("stop #2   # job 2, as the panel names it", ["stop", "#2"], True),
    ("--nproc 2 #2 GPUs here", ["--nproc", "2"], False),  # a cell's flags: a comment
    ("stop #2nd try", ["stop"], True),
    ('--args "a \\" # b" # c', ["--args", 'a " # b'], False),
])
def test_a_hash_that_starts_a_word_outside_quotes_starts_a_comment(line, words, refs):
    """As in a shell: IPython hands a line magic its comment too; but %elastic's
    subcommands take a job as the panel numbers it (#2)."""
    from elastic_magic.notebook.magic_cells import magic_words

    assert magic_words(line, "%elastic", job_refs=refs) == words
    with pytest.raises(UsageError, match="check the quotes"):
        magic_words("stop 'em-1", "%elastic")



@pytest.mark.unit
@pytest.mark.parametrize(("words", "parsed"), [
    (["4"], (4, [], False, ())),
    (["4", "2", "--now"], (4, ["2"], True, ())),
    (["4", "--include", "1,3", "em-x"], (4, ["em-x"], False, (1, 3))),
])
def test_scale_words_name_the_size_the_job_and_the_slots_brought_back(words, parsed):
    from elastic_magic.notebook.magic_cells import parse_scale

    assert parse_scale(words) == parsed
    with pytest.raises(UsageError, match="--include takes worker slots"):
        parse_scale(["4", "--include", "one"])
