"""Tutorial notebooks run top to bottom in a real Jupyter kernel (nbclient)."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import nbformat
import netns
import pytest
import slurm
import torch
from nbclient import NotebookClient

pytestmark = pytest.mark.kernel

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
# Where the executed notebooks go (docs/refresh.py points it at a folder of its own; the
# docs site shows them, outputs included, as its tutorials).
EXECUTED = os.environ.get("ELASTIC_MAGIC_TUTORIALS")


def execute(name: str, tmp_path: Path, timeout: int = 300):
    """Run a tutorial top to bottom in a real kernel, from a scratch folder, every cell as
    ``jupyter nbconvert --execute`` runs it (none is skipped: each runs on CPUs). Nothing
    may be left in notebooks/."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    before = sorted(p.name for p in NOTEBOOKS.iterdir())
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    heard = Heard()
    client.log.addHandler(heard)
    try:
        client.execute()
    finally:
        client.log.removeHandler(heard)
    assert sorted(p.name for p in NOTEBOOKS.iterdir()) == before  # nothing left behind
    # the extension's comm is the frontend's to open: a headless run hears nothing of it
    assert not [m for m in heard.messages if "comm target" in m], heard.messages
    if EXECUTED:
        nbformat.write(nb, Path(EXECUTED, name))
    return nb


class Heard(logging.Handler):
    """What nbclient warned about while it ran a notebook."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def shown(nb) -> str:
    """What the code cells of an executed notebook show, as text."""
    return "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")


def _text(cell) -> str:
    """What a reader sees without a kernel: streams and the plain-text of displays."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif "data" in output:
            parts.append(output.data.get("text/plain", ""))
    return "".join(parts)


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: strip outputs"


def test_course_is_numbered_in_order_and_no_cell_is_left_to_a_gpu():
    names = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert [n[:3] for n in names] == [f"{i:02d}_" for i in range(1, len(names) + 1)]
    for name in names:  # each title carries its number
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        assert nb.cells[0].source.startswith(f"# {int(name[:2])}. "), name
        # a user's nbconvert runs every cell: none may need what a CPU machine lacks (a
        # cell that shows a failure says so with nbconvert's own tag)
        tags = {t for c in nb.cells for t in c.get("metadata", {}).get("tags", [])}
        assert tags <= {"raises-exception"}, (name, tags)
        assert not [c for c in nb.cells if c.cell_type == "code"
                    and "--nproc gpu" in c.source.partition("\n")[0]], name


def test_quickstart_trains_and_recovers(tmp_path):
    nb = execute("01_quickstart.ipynb", tmp_path)
    text = shown(nb)
    # The dashboards were replaced by static records that render without a kernel.
    for epoch in range(5):
        assert f"[rank 0] epoch {epoch}: loss" in text
    assert "[rank 1] rank 1 of 2 done" in text
    assert "loss per epoch:" in text
    assert "rank 1 failed: RuntimeError: simulated crash on rank 1 (cell line 7)" in text
    assert "[rank 1] rank 1 finished in attempt 1" in text
    assert "succeeded · world size 2 · 1 machine · restarts 1/1" in text
    html = [o.data["text/html"] for c in nb.cells for o in c.get("outputs", [])
            if "data" in o and "text/html" in o.data]
    assert len(html) == 2 and all("elastic-record" in h for h in html)


def test_torchrun_script_runs_unchanged(tmp_path):
    text = shown(execute("02_torchrun_script.ipynb", tmp_path))
    assert "[rank 1] rank 1 of 2 (local rank 1, MASTER_ADDR" in text  # torchrun's env
    for epoch in range(3):  # --args reached argparse, word by word
        assert f"[rank 0] epoch {epoch}: mean loss" in text
    assert "[rank 0] trained 3 epochs on 2 ranks (lr 0.05)" in text
    if torch.cuda.is_available():  # one worker per GPU, NCCL
        assert re.search(r"\[rank 0\] rank 0 of \d+ on .*: nccl all_reduce gives \d", text), text
    else:  # one worker, gloo: a new user's CPU machine runs the cell too
        assert "[rank 0] rank 0 of 1 on a CPU: gloo all_reduce gives 1" in text, text


def test_elastic_training_recovers_and_resizes(tmp_path):
    text = shown(execute("03_elastic_training.ipynb", tmp_path, timeout=600))
    # A --bg cell's dashboard, saved by a run without widgets: its record if the job's end
    # reached the display in time, else its job in words ("elastic job em-...: its live
    # dashboard shows where widgets are drawn ..."), never an object's address.
    assert "object at 0x" not in text
    assert "requested[elastic]" not in text  # a command's line and the job's, apart
    assert "starting at step 30 with world size 2" in text  # the restart resumed
    assert "same parameters as the uninterrupted run, bit for bit" in text
    assert "resize to 3 workers requested" in text and "resize to 1 worker requested" in text
    assert "succeeded, world size 1, restarts 0/0" in text and "resizes: 2" in text
    assert "same parameters as the uninterrupted run\n" in text


def test_multi_node_tutorial_joins_resizes_and_leaves(tmp_path):
    nb = execute("05_multi_node.ipynb", tmp_path, timeout=600)
    text = shown(nb)
    # The printed command names the token's private file: the notebook, saved with its
    # outputs, widget state included, holds no token (32 hex digits) anywhere; the file
    # went with the job.
    found = re.search(r"elastic-magic join 127\.0\.0\.1:\d+ --token-file (\S+)", text)
    assert found, text
    assert not Path(found.group(1)).exists()
    tokens = Path(os.environ["XDG_CACHE_HOME"], "elastic_magic", "tokens")  # the kernel's too
    assert not tokens.exists() or list(tokens.iterdir()) == []
    saved = nbformat.writes(nb)
    widgets = nb.metadata.get("widgets", {}).get(
        "application/vnd.jupyter.widget-state+json", {}).get("state", {})
    hex32 = set(re.findall(r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])", saved))
    assert hex32 <= set(widgets), hex32 - set(widgets)  # widget ids only
    assert "running: world size 2, machines 2" in text, text  # the other machine joined
    assert "running: world size 3, machines 2" in text, text  # this machine grew to 2
    assert "other machine exited with 130" in text, text
    assert "running: world size 2, machines 1" in text  # it left; the job went on here
    assert "restarts: 0" in text and "same parameters as the run on one machine" in text
    # From its own log. Which round: a machine that arrives during a round's last call waits
    # for the next one, so there may be one more.
    assert re.search(r"rendezvous round \d+: world size 3 on 2 machines", text), text


def test_sessions_tutorial_keeps_state_recovers_and_resizes(tmp_path):
    text = shown(execute("04_sessions.ipynb", tmp_path))
    assert "[rank 1] rank 1 of 2 ready at step 0" in text
    assert re.search(r"\[rank 0\] step 20: loss \d", text), text
    assert "loss after 10 more steps" in text
    assert "rank 1 failed: killed by SIGKILL" in text
    # --survivors: rank 0 stayed in its process with its namespace (``last``, from an
    # ordinary cell); the new rank 1 replayed the setup cell alone on the new group (it
    # uses no collective), and the next cell trained on both.
    assert "ranks 0 stayed in their processes" in text
    assert "[rank 1] rank 1 of 2 ready at step 30" in text
    assert "session re-formed: 1 setup cell replayed, State at step 30" in text
    survivor = re.search(r"rank 0: pid (\d+) \(was (\d+)\), step 30, last = (\S+) \(was (\S+)\)",
                         text)
    assert survivor and survivor[1] == survivor[2] and survivor[3] == survivor[4], text
    new = re.search(r"rank 1: pid (\d+) \(was (\d+)\), step 30: a new process", text)
    assert new and new[1] != new[2], text
    assert re.search(r"\[rank 0\] step 35: loss \d", text), text
    assert "ranks 0, 1 stayed in their processes" in text  # the resize to 3
    assert re.search(r"\[rank 2\] rank 2 of 3: step 35, pid \d", text), text
    assert "restarts: 1/3" in text and "session ended" in text


def test_lightning_and_hf_trainer_resume_from_the_last_commit(tmp_path):
    """Rank 1 dies in step 11 of the first attempt (commits every 4 steps): in both halves
    the restarted ``fit`` / ``train()`` begins at the commit of step 8 and trains 9-12."""
    pytest.importorskip("pytorch_lightning")
    pytest.importorskip("transformers")
    text = shown(execute("08_lightning_and_hf_trainer.ipynb", tmp_path))
    lightning, hf = text.split("train() starts at step 0", 1)
    for half, start in ((lightning, "fit starts"), (hf, "train() starts")):
        assert f"[rank 0] attempt 1: {start} at step 8\n" in half, half
        # only the steps since the last commit ran again
        assert re.findall(r"\[rank 0\] attempt 1: step (\d+) done", half) == [
            "9", "10", "11", "12"], half
        assert "rank 1 failed: killed by SIGKILL" in half
        assert "global step on each rank: {0: 12, 1: 12}" in half
        assert "succeeded, world size 2, restarts 1/1" in half


def test_debugging_tutorial_names_root_cause_logs_and_stacks(tmp_path):
    text = shown(execute("06_debugging.ipynb", tmp_path))
    cause = "rank 2: FileNotFoundError: [Errno 2] No such file or directory: " \
            "'/nonexistent/shard-2.pt' (cell line 7)"
    assert f"root cause: {cause} (attempt 1 of 1)" in text  # the record's box
    assert f"root cause: {cause}\n" in text  # result.failure, printed
    # %elastic logs: the path of the file, and its tail (the traceback's last line)
    assert re.search(r"==> \S+/em-[0-9a-f]+/\S+/rank_2/stderr\.log <==\n(.*\n){0,2}"
                     r"FileNotFoundError", text), text
    assert "rank_0/stdout.log" in text
    # %elastic stacks on the hanging job: rank 1 where it waits, rank 0 in the barrier
    live = text.split("==> rank 0 <==", 1)[1]
    rank0, rank1 = live.split("==> rank 1 <==", 1)
    assert "Cell line 11, in <module>" in rank0 and "in barrier" in rank0
    assert "Cell line 6, in wait_for_data" in rank1.split("==> ", 1)[0]
    assert "stopped; its workers have exited" in text
    # --stall-timeout names the stalled rank and keeps the stacks
    assert "root cause: rank 1: stalled: no progress for 3s, outside any collective" in text
    assert "rank 0: waited in barrier at cell line 11" in text


def test_cluster_tutorial_grows_gives_back_and_leaves_nothing(tmp_path, monkeypatch):
    """Against the tests' Slurm cluster (tests/slurm.py: two machines in network
    namespaces) where one can be started, the options in a launcher config file as a user's
    would be; elsewhere with the local launcher (CI has Slurm: there it must run)."""
    reason = netns.unavailable() or slurm.unavailable()
    if reason is None:
        return _cluster_tutorial_on_slurm(tmp_path, monkeypatch)
    if os.environ.get("CI"):
        pytest.fail(f"CI runs the tutorial against Slurm in namespaces, but {reason}")
    text = shown(execute("07_cluster.ipynb", tmp_path, timeout=600))
    assert "launcher local" in text
    assert "local1#1: running" in text  # %elastic status lists the allocations
    _assert_tutorial_ran(text)


def _cluster_tutorial_on_slurm(tmp_path, monkeypatch) -> None:
    from test_launchers import _in_namespaces
    from test_slurm import options, slurm_cluster

    with netns.network_of(2, tmp_path) as network, \
            slurm_cluster(network, tmp_path, monkeypatch) as cluster:
        config = tmp_path / "launchers.ini"
        config.write_text("[slurm]\n" + "".join(
            f"{k} = {v}\n" for k, v in {**options(tmp_path), "nproc": "1"}.items()))
        # What the tutorial says to set for a cluster; the kernel inherits it.
        monkeypatch.setenv("ELASTIC_MAGIC_LAUNCHERS", str(config))
        monkeypatch.setenv("TUTORIAL_LAUNCHER", "slurm")
        monkeypatch.setenv("TUTORIAL_HEAD", network.head_address)
        text = shown(execute("07_cluster.ipynb", tmp_path, timeout=600))
        assert "launcher slurm" in text
        assert f"launcher config {config}" in text
        assert re.search(r"\d+: running on em[12]", text), text  # squeue's, in the status
        _assert_tutorial_ran(text)
        deadline = time.monotonic() + 30  # nothing left: no Slurm job, token, join
        while cluster.queue() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert cluster.queue() == []
        assert list((tmp_path / "tokens").iterdir()) == []
        assert _in_namespaces(network, "elastic_magic.cli") == []


def _assert_tutorial_ran(text: str) -> None:
    assert "running on 3 machines, world size 3" in text
    assert "2 machines asked of its launcher" in text
    assert "running on 2 machines, world size 2" in text
    assert "restarts: 0" in text and "same parameters as the run on one machine" in text
    assert "allocations left: none" in text


def test_detach_tutorial_picks_the_training_up_again(tmp_path, monkeypatch):
    from elastic_magic.agent.handles import attached, detached_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the kernel's too
    nb = execute("09_detach.ipynb", tmp_path)
    text = shown(nb)
    assert "'%%elastic --nproc 2 --detach --bg -o job')]" in text  # detached_jobs() lists it
    # The attaching cell: its dashboard, or the record that replaced it when the job's end
    # reached the display before the notebook ended (the whole run, from its first round).
    (attach,) = [_text(c) for c in nb.cells if c.source.startswith("%elastic attach")]
    run_id = re.search(r"\('(em-[0-9a-f]+)', '%%elastic", text)[1]  # type: ignore[index]
    assert run_id in attach, attach
    if "succeeded" in attach:
        assert "rendezvous round 1: world size 2" in attach
        assert "[rank 0] step 20: loss" in attach and "[rank 1] step 60: loss" in attach
    assert re.search(r"succeeded \{0: -?[\d.]+, 1: -?[\d.]+\}", text), text
    folder = detached_folder.runtime_folder()
    deadline = time.monotonic() + 30  # the result taken, the agent (and the standby) gone
    while list(folder.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert attached.detached_jobs() == [] and list(folder.iterdir()) == []
