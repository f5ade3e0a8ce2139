import os

import pytest

from elastic_magic.spec import JobSpec, SpecError, parse_env, resolve_nproc

pytestmark = pytest.mark.unit


def test_nproc_numbers_and_words():
    assert resolve_nproc(3, gpus=0) == 3
    assert resolve_nproc("4", gpus=0) == 4
    assert resolve_nproc("cpu", gpus=0) == os.cpu_count()
    assert resolve_nproc("auto", gpus=0) == os.cpu_count()
    assert resolve_nproc("auto", gpus=8) == 8
    assert resolve_nproc("gpu", gpus=2) == 2
    assert resolve_nproc(None, gpus=0) == 1
    assert resolve_nproc(None, gpus=4) == 4


@pytest.mark.parametrize(
    ("value", "fragment"),
    [(0, "at least 1"), ("-2", "at least 1"), ("many", "whole number"), ("gpu", "no CUDA")],
)
def test_bad_nproc_says_what_to_do(value, fragment):
    with pytest.raises(SpecError, match=fragment):
        resolve_nproc(value, gpus=0)


def test_backend_resolution_and_errors(tmp_path):
    assert JobSpec.create(2, gpus=0, log_dir=tmp_path).backend == "gloo"
    assert JobSpec.create(2, gpus=2, log_dir=tmp_path).backend == "nccl"
    with pytest.raises(SpecError, match="use gloo"):
        JobSpec.create(2, backend="nccl", gpus=0, log_dir=tmp_path)
    with pytest.raises(SpecError, match="--nproc 2, or --backend gloo"):
        JobSpec.create(4, backend="nccl", gpus=2, log_dir=tmp_path)
    with pytest.raises(SpecError, match="choose one of"):
        JobSpec.create(2, backend="mpi", gpus=0, log_dir=tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_restarts": -1}, "between 0 and"),
        ({"monitor_interval": 0}, "above 0"),
        ({"timeout": -5}, "above 0"),
        ({"pull": ["not a name"]}, "not a Python variable name"),
        ({"nnodes": "1:2", "rdzv_endpoint": "0.0.0.0:29400"}, "not an address the other"),
    ],
)
def test_bad_values(tmp_path, kwargs, fragment):
    with pytest.raises(SpecError, match=fragment):
        JobSpec.create(1, gpus=0, log_dir=tmp_path, **kwargs)


WHOLE_NUMBERS = ("nproc", "min_nproc", "max_nproc", "max_restarts")
SECONDS = ("timeout", "monitor_interval")
MEANINGLESS = ["inf", "-inf", "nan", "-1", "1e300", str(10**30), float("inf"), float("nan"),
               10**30, -3, True]


@pytest.mark.parametrize("value", [*MEANINGLESS, "0", 0.0])
@pytest.mark.parametrize("name", SECONDS)
def test_every_seconds_option_refuses_what_it_cannot_mean(tmp_path, name, value):
    """As flag text or Python values: a clear SpecError before anything starts, never a
    crash in the agent (``--timeout inf`` once overflowed torch's timedelta there)."""
    with pytest.raises(SpecError, match=r"seconds|number"):
        JobSpec.create(2, gpus=0, log_dir=tmp_path, **{name: value})


@pytest.mark.parametrize("value", [*MEANINGLESS, 2.5, "2.5"])
@pytest.mark.parametrize("name", WHOLE_NUMBERS)
def test_every_count_option_refuses_what_it_cannot_mean(tmp_path, name, value):
    options = {"nproc": 2, name: value}
    with pytest.raises(SpecError, match=r"number|between|at least|at most"):
        JobSpec.create(gpus=0, log_dir=tmp_path, **options)


def test_numbers_at_their_bounds_are_kept(tmp_path):
    spec = JobSpec.create(2, gpus=0, log_dir=tmp_path, timeout=30 * 24 * 3600,
                          monitor_interval=60, max_restarts=10_000, max_nproc=1024)
    assert (spec.timeout, spec.monitor_interval, spec.max_restarts) == (2592000.0, 60.0,
                                                                         10_000)


def test_env_parsing():
    assert parse_env(["A=1", "B_2=x=y", "C="]) == {"A": "1", "B_2": "x=y", "C": ""}
    assert parse_env({"K": 5}) == {"K": "5"}
    with pytest.raises(SpecError, match="KEY=VALUE"):
        parse_env(["NOEQUALS"])
    with pytest.raises(SpecError, match="not a valid variable name"):
        parse_env(["1BAD=x"])


def test_log_dir_must_be_creatable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SpecError, match="cannot create it"):
        JobSpec.create(1, gpus=0, log_dir=blocker / "logs")
    spec = JobSpec.create(1, gpus=0, log_dir=tmp_path / "new" / "logs")
    assert spec.log_dir.is_dir()


def test_unknown_option_names_the_valid_ones(tmp_path):
    with pytest.raises(TypeError, match=r"did you mean 'nproc'\?.*max_restarts"):
        JobSpec.create(nprocs=2, gpus=0, log_dir=tmp_path)


def test_flag_text_and_python_values_are_checked_alike(tmp_path):
    spec = JobSpec.create("2", gpus=0, log_dir=tmp_path, max_restarts="3", timeout="9.5",
                          argv="--lr '0.1 x'", pull="a, b", env=["K=V"], nnodes="1:2")
    assert (spec.max_restarts, spec.timeout, spec.argv) == (3, 9.5, ["--lr", "0.1 x"])
    assert (spec.pull, spec.env, spec.max_nodes) == (["a", "b"], {"K": "V"}, 2)
    with pytest.raises(SpecError, match="expected a whole number"):
        JobSpec.create(1, gpus=0, log_dir=tmp_path, max_restarts="many")
    with pytest.raises(SpecError, match="quote it as one string"):
        JobSpec.create(1, gpus=0, log_dir=tmp_path, argv="'unclosed")


def test_joining_machine_follows_the_head_except_its_own_options(tmp_path):
    head = JobSpec.create(2, gpus=0, log_dir=tmp_path / "head", max_restarts=2, timeout=50,
                          env={"A": "1"}, argv=["--x"], pull=["w"], nnodes="1:3",
                          min_nproc=1, max_nproc=4, init_process_group=False)
    node = JobSpec.for_machine(head, nproc=1, gpus=0, log_dir=tmp_path / "node")
    for name in ("backend", "max_restarts", "monitor_interval", "timeout",
                 "init_process_group", "env", "argv", "pull", "min_nodes", "max_nodes"):
        assert getattr(node, name) == getattr(head, name), name
    assert (node.nproc, node.min_nproc, node.max_nproc) == (1, 1, 1)
    assert node.log_dir == tmp_path / "node" and node.checkpoint_dir is None
    with pytest.raises(TypeError, match="per-machine option 'timeout'"):
        JobSpec.for_machine(head, nproc=1, gpus=0, timeout=5)
    nccl = JobSpec.create(1, gpus=1, log_dir=tmp_path, nnodes=2)
    with pytest.raises(SpecError, match="use gloo"):  # checked against this machine's GPUs
        JobSpec.for_machine(nccl, nproc=1, gpus=0, log_dir=tmp_path)


def test_the_magics_help_formats_every_options_text():
    """argparse reads a help text as a %-format: an option's text that names a magic
    must escape it (%%elastic), or the extension fails to load."""
    from elastic_magic.notebook.magics import ElasticMagics
    from elastic_magic.spec import OPTIONS, options_help

    parser = ElasticMagics.elastic.parser  # type: ignore[attr-defined]
    shown = " ".join(parser.format_help().split())
    assert "--detach" in shown and "%elastic attach" in shown
    assert "%%" not in options_help()
    assert all(option.help_text.count("%") % 2 == 0 for option in OPTIONS)
