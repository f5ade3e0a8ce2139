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


@pytest.mark.parametrize(
    ("line", "cell", "fragment"),
    [
        ("--nproc zero", "x = 1", "whole number"),
        ("--nproc 0", "x = 1", "at least 1"),
        ("--backend nccl", "x = 1", "use gloo"),
        ("--backend mpi", "x = 1", "choose one of"),
        ("--max-restarts -1", "x = 1", "0 or more"),
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
