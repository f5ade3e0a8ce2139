"""Every code block of the README runs in a test, as a reader copies it, or is listed here with
the reason it cannot run on this machine and what checks it instead. The examples with
``...`` placeholders run with those lines filled in (``readme.cells(..., fill=...)``), the
rest exactly as written, in a real IPython shell with real workers."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import readme

ROOT = Path(__file__).resolve().parents[1]

# Blocks no test runs, by their first line: why, and what checks them instead.
NOT_RUN = {
    "python3 -m venv .venv && .venv/bin/pip install -c": "the quickstart: it installs, then "
    "runs notebook 01 with nbconvert, as test_notebooks::test_quickstart_trains_and_recovers does",
    ".venv/bin/python -m pytest -m unit": "the unit tier; .ci/run runs every tier",
    " pool: left out": "a line of output",
    "%elastic jobs ": "the list of %elastic commands, each run by test_magic and test_kernel",
    "%%elastic --nproc 4 --max-restarts 3 --survivors": "the resize example's cell under other "
    "flags, which test_every_magic_line_parses checks",
    "%%elastic --nproc 2 --nnodes 1:4 --rdzv-endpoint 10.0.0.5": "flags only (another "
    "machine's address): test_every_magic_line_parses; jobs of several machines run in "
    "test_multinode and test_networks",
    "elastic-magic join 10.0.0.5": "another machine: test_the_join_commands_parse; the printed "
    "command runs in test_multinode and tutorial 05",
    "[elastic] machine 10.0.0.7": "a line of output",
    "sudo ip link add em-br": "needs root and changes the machine's network: tests/netns.py "
    "makes the same bridge and namespaces",
    "sudo ip netns exec machine1": "the same; test_the_join_commands_parse parses its join",
    "sbatch --nodes 4 examples/slurm/join.sbatch": "needs a Slurm cluster: test_schedulers "
    "runs the script with a stand-in srun, test_slurm the launcher against real daemons",
    "%%elastic --nnodes 1:4 --rdzv-endpoint 10.0.0.5 --launcher slurm": "flags only: "
    "test_every_magic_line_parses; test_slurm and test_launchers run the launchers",
    "%%elastic --nnodes 1:3 --rdzv-endpoint 10.0.0.5:29400": "flags only (the head of a "
    "Kubernetes job): test_every_magic_line_parses",
    "kubectl create secret generic": "needs a Kubernetes cluster: test_schedulers checks the "
    "manifest's token wiring and runs its command against a real head",
    "kubectl apply -f examples/kubernetes": "the same",
    "%%elastic --max-restarts 3 -o run": "needs CUDA GPUs: test_gpu_resume trains with AMP, "
    "a GradScaler and dropout on GPUs, killed and resized; CI has no GPU",
    "%%elastic --nproc 8 --backend gloo": "flags only: test_every_magic_line_parses; 8 "
    "workers on a 2-core CI machine would only measure its load",
    "pip install -c constraints/ci.txt -e '.[bench]'": "the bench extra, then benchmarks that "
    "take minutes to an hour: test_the_benchmark_commands_name_real_scenarios",
    "  the kernel ": "a drawing",
}

RESIZE_FILL = {"...one step...": """\
loss = torch.nn.functional.mse_loss(ddp_model(x), y)
opt.zero_grad()
scaler.scale(loss).backward()
scaler.step(opt)
scaler.update()
sched.step()
ema.update_parameters(model)"""}


def blocks_run_by_tests() -> dict[str, str]:
    """Where a block is (page:line) -> the test file that runs it: every ``readme.block(...)`` or
    ``readme.cells(...)`` call with its text written out, in every test file."""
    found = {}
    for path in sorted(ROOT.glob("tests/*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "readme"
                    and node.func.attr in ("block", "cells")
                    and all(isinstance(arg, ast.Constant) for arg in node.args[:2])):
                args = [arg.value for arg in node.args[:2]]
                found[readme.block(*args).where] = path.name
    return found


@pytest.mark.unit
def test_every_readme_block_runs_in_a_test_or_says_why_not():
    ran = blocks_run_by_tests()
    unexplained, both = [], []
    for block in readme.all_blocks():
        excused = [first for first in NOT_RUN if block.first.startswith(first)]
        if block.where in ran and excused:
            both.append(f"{block.where}: run by {ran[block.where]} and listed in NOT_RUN")
        elif block.where not in ran and not excused:
            unexplained.append(f"{block.where}: {block.first!r}")
    assert not unexplained, ("code blocks of the README and the docs that no test runs (run "
                             "them with readme.block, or say why not in NOT_RUN):\n"
                             + "\n".join(unexplained))
    assert not both, "\n".join(both)
    firsts = [block.first for block in readme.all_blocks()]
    stale = [first for first in NOT_RUN if not any(f.startswith(first) for f in firsts)]
    assert not stale, f"NOT_RUN names blocks the README and the docs no longer have: {stale}"


def test_the_blocks_no_test_runs_are_valid_python_or_shell():  # bash -n: a process
    """What cannot run here (a GPU's cell, a cluster's commands) is at least well formed: a
    cell's Python parses (a line of prose between dots, ``...one step...``, and a magic's
    line stand for a statement), and a shell command passes ``bash -n``."""
    shell = ("sudo ", "sbatch ", "kubectl ", "python ", "pip ", "elastic-magic ", "for ")
    checked = 0
    for block in readme.all_blocks():
        if not any(block.first.startswith(first) for first in NOT_RUN):
            continue
        lines = block.text.splitlines()
        if block.first.startswith("%%elastic"):
            body = "\n".join("pass" if re.fullmatch(r"\s*(\.\.\..*\.\.\.|%.*)", line)
                             else line for line in lines)  # magics (cells) too
            try:
                ast.parse(body or "pass")
            except SyntaxError as exc:
                raise AssertionError(f"{block.where}: {exc}") from None
            checked += 1
        elif block.first.lstrip().startswith(shell):
            done = subprocess.run(["bash", "-n", "-c", block.text], capture_output=True,
                                  text=True)
            assert done.returncode == 0, f"{block.where}: {done.stderr}"
            checked += 1
    assert checked >= 10, checked


@pytest.mark.unit
def test_the_block_reader_finds_indented_and_fenced_blocks_and_fills_placeholders():
    text = ("Text.\n\n    a = 1\n\n    b = 2\nText\n    not a block\n\n```\nfenced\n```\n"
            "\n    %load_ext x\n\n    %%elastic --nproc 2\n    for i in x:\n        ...step...\n")
    assert [(b.line, b.text) for b in readme.blocks(text)] == [
        (3, "a = 1\n\nb = 2"), (10, "fenced"),
        (13, "%load_ext x\n\n%%elastic --nproc 2\nfor i in x:\n    ...step...")]
    # a MyST directive is the docs build's to run, not a block (its fence neither)
    page = "# A page\n\n```{code-cell} ipython3\nx = 1\n```\n\n```bash\nls\n```\n"
    assert [(b.line, b.text, b.where) for b in readme.blocks(page, "docs/p.md")] == [
        (8, "ls", "docs/p.md:8")]
    assert readme.magic("%%elastic --nproc 2\nx = 1") == ("--nproc 2", "x = 1\n")
    twice = "%%elastic --nproc 4"  # two blocks begin so: the caller says which
    with pytest.raises(LookupError, match="2 code blocks"):
        readme.block(twice)
    with pytest.raises(KeyError, match="placeholder"):
        readme.cells("%%elastic --bg --nproc 2")


def readme_lines(prefix: str) -> list[str]:
    return [line.strip() for block in readme.all_blocks() for line in block.text.splitlines()
            if line.strip().startswith(prefix)]


@pytest.mark.unit
def test_every_magic_line_parses(monkeypatch, tmp_path):
    """Every %%elastic line of the README is a valid job (another machine's address read as
    this one's), and the session's start line too."""
    from elastic_magic.notebook.magic_cells import parse_flags
    from elastic_magic.notebook.magics import ElasticMagics
    from elastic_magic.spec import OPTION_NAMES, JobSpec

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no launcher config of yours
    session = "%elastic session start"
    lines = readme_lines("%%elastic") + [
        line.removeprefix(session) for line in readme_lines(session)]
    assert len(lines) >= 10
    for line in lines:
        flags = line.removeprefix("%%elastic").replace("10.0.0.5", "127.0.0.1")
        opts = parse_flags(ElasticMagics.elastic.parser, flags, line)
        JobSpec.create(**{k: v for k, v in vars(opts).items() if k in OPTION_NAMES})


@pytest.mark.unit
def test_the_join_commands_parse():
    from elastic_magic.cli import _parser

    commands = [line for block in readme.all_blocks() for line in block.text.splitlines()
                if re.search(r"(^elastic-magic|\")\s+join ", line)]
    assert len(commands) == 2
    for command in commands:
        words = shlex.split(command)
        args = _parser().parse_args(words[words.index("join"):])
        assert args.command == "join" and args.token_file is not None


@pytest.mark.unit
def test_the_launcher_config_is_what_the_launchers_take(tmp_path):
    """The README's launchers.ini: every option, those in comments too, is one the launcher
    knows, and the file as written is taken."""
    from elastic_magic.launchers import configured_options, launcher_class

    text = readme.block("[slurm]").text
    path = tmp_path / "launchers.ini"
    path.write_text(text)
    path.chmod(0o600)
    for name in ("slurm", "ssh"):
        options = configured_options(name, path)
        assert options, name
        launcher_class(name)(options)
    section = ""
    for line in text.splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        for key, value in re.findall(r"(?:^#\s*|\s{3})(\w+) = (\S+)", line):
            launcher_class(section)({**configured_options(section, path), key: value})


@pytest.mark.unit
def test_the_test_command_is_what_ci_runs():
    command = readme.block("python3 -m venv .venv && .venv/bin/pip install -q").text
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.unit
def test_the_benchmark_commands_name_real_scenarios():
    source = (ROOT / "benchmarks" / "__main__.py").read_text()
    names = set(re.findall(r'Scenario\(\s*"(\w+)"', source))
    flags = set(re.findall(r'add_argument\("(--\w+)"', source))
    assert len(names) > 10 and "--only" in flags
    for line in readme_lines("python -m benchmarks"):
        words = shlex.split(line.split("#")[0])[3:]
        assert {w for w in words if w.startswith("--")} <= flags, line
        if "--only" in words:
            assert set(words[words.index("--only") + 1].split(",")) <= names, line


@pytest.mark.unit
def test_every_link_and_picture_of_the_readme_and_the_docs_is_there():
    """A link to a page or a file of the repository (and a screenshot) from the README or a
    docs page leads to something that exists, as GitHub and the docs site resolve it."""
    broken = []
    for page in readme.documents():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # another site's, or a heading of the page
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


@pytest.mark.unit
def test_every_file_of_the_layout_exists():
    """Each name of the README's list of files, in the folders its indentation nests."""
    listed: list[str] = []
    folders: list[tuple[int, str]] = []  # (indent, path) of the folders open at a line
    for line in readme.block("elastic_magic/__init__.py ").text.splitlines():
        names = re.match(r"\s*((?:[\w./]+, )*[\w./]+)\s{2,}", line)
        if not names or not re.search(r"(\.py|/)$", names[1]):
            continue  # a description's second line
        indent = len(line) - len(line.lstrip())
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parent = folders[-1][1] if folders else ""
        for name in names[1].split(", "):
            if name.endswith("/"):
                folders.append((indent, parent + name))
            listed.append(parent + name)
    missing = [name for name in listed if not (ROOT / name).exists()]
    assert len(listed) > 80 and not missing, missing


# -- the examples, run -----------------------------------------------------------------------


def test_the_first_example_runs_as_written(ip):
    load, cell = readme.cells("%load_ext elastic_magic")
    assert ip.run_cell(load).success
    outcome = ip.run_cell(cell)
    assert outcome.success, outcome.error_in_exec
    assert ip.user_ns["job"].values == {0: 1.0, 1: 1.0}


def test_the_resize_example_trains_resizes_and_commits(ip):
    """The "resize and resume" cell, its step filled in, started in the background; the
    README's `%elastic scale 3` applies at a commit and the training ends at step 30."""
    ip.run_cell("import torch\nEPOCHS = 3\ndataset = torch.utils.data.TensorDataset("
                "torch.randn(960, 8, generator=torch.Generator().manual_seed(0)), "
                "torch.randn(960, 1, generator=torch.Generator().manual_seed(1)))")
    (cell,) = readme.cells("%%elastic --bg --nproc 2", fill=RESIZE_FILL)
    line, body = readme.magic(cell)
    made = ("import torch\n"
            "model = torch.nn.Linear(8, 1)\n"
            "ddp_model = torch.nn.parallel.DistributedDataParallel(model)\n"
            "opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)\n"
            "sched = torch.optim.lr_scheduler.StepLR(opt, 10)\n"
            "scaler = torch.amp.GradScaler('cpu')\n"
            "ema = torch.optim.swa_utils.AveragedModel(model)\n")
    assert ip.run_cell(f"%%elastic {line} --text\n{made}{body}").success
    ip.run_line_magic("elastic", "scale 3")
    result = ip.user_ns["job"].wait()
    assert result.ok and result.world_size == 3, result
    assert result.commit is not None and result.commit["step"] == 30  # 3 epochs of 10 steps


def test_the_distributed_sampler_lines_split_the_data(ip):
    ip.run_cell("import torch\ndataset = torch.utils.data.TensorDataset(torch.arange(64))")
    code = readme.block("sampler = DistributedSampler(dataset").text
    outcome = ip.run_cell(
        "%%elastic --nproc 2 --text -o sampled\nimport elastic_magic\n"
        f"from torch.utils.data import DistributedSampler\n{code}\n"
        "sorted(i for (batch,) in loader for i in batch.tolist())")
    assert outcome.success, outcome.error_in_exec
    values = ip.user_ns["sampled"].values
    assert len(values[0]) == len(values[1]) == 32
    assert sorted(values[0] + values[1]) == list(range(64))


def test_the_run_decorator_example_trains_to_its_step(ip):
    """@elastic_magic.run as the README writes it, with its model, data and step filled in:
    four ranks, 5 epochs of 10 global batches, every step committed."""
    ip.run_cell("import torch\nEPOCHS = 5\n"
                "def make_model():\n    return torch.nn.Linear(8, 1)\n"
                "xs = torch.randn(2560, 8, generator=torch.Generator().manual_seed(0))\n"
                "data = torch.utils.data.TensorDataset(xs, xs.sum(1, keepdim=True))")
    (cell,) = readme.cells("%%elastic --nproc 4 --survivors", fill={
        "...one step with model...":
            "loss = torch.nn.functional.mse_loss(model(x), y)\noptimizer.zero_grad()\n"
            "loss.backward()\noptimizer.step()"})
    line, body = readme.magic(cell)
    outcome = ip.run_cell(f"%%elastic {line} --text -o trained\n{body}state.step")
    assert outcome.success, outcome.error_in_exec
    assert ip.user_ns["trained"].values == {rank: 50 for rank in range(4)}
    assert ip.user_ns["trained"].commit["step"] == 50


def test_the_session_examples_run_as_written(ip):
    """The session's magics (the training cell filled in), then the same from Python."""
    for cell in readme.cells("%elastic session start",
                             fill={"...train a little, state.commit()...":
                                   "state.step += 1\nstate.commit()\nstate.step"}):
        outcome = ip.run_cell(cell)
        assert outcome.success, (cell, outcome.error_in_exec)
    ip.run_cell("import elastic_magic")
    outcome = ip.run_cell(readme.block("with elastic_magic.Session(").text)
    assert outcome.success, outcome.error_in_exec
