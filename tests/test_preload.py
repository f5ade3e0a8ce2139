"""What the warm pool preloads: DDP's path and data loading by default, what a kernel's
cells imported (learned, rebuilt in the background), what a job names with --preload; never
a module of the user's folders, never one that starts a thread or fails; a cell never waits
for a rebuild."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
from IPython.core.error import UsageError

import elastic_magic as em
from elastic_magic.agent.node import pool as pool_module
from elastic_magic.agent.node.pool import WarmPool
from elastic_magic.worker import import_checks, imports

# A cell's view, before its first line of its own: what it already has, and which zygote
# forked it (its shepherd's parent).
SEEN = textwrap.dedent("""
    import sys
    seen = {name: name in sys.modules for name in NAMES}
    import os
    with open(f"/proc/{os.getppid()}/stat") as stat:
        zygote = int(stat.read().rpartition(")")[2].split()[1])
    for name in NAMES:
        __import__(name)
    dict(seen=seen, zygote=zygote)
""")
REBUILD_TIMEOUT = 180.0  # importing torch again on a busy 2-core machine


@pytest.fixture
def pool():
    """A pool of this test's own: nothing learned by earlier tests."""
    pool_module.shutdown_pool()
    fresh = WarmPool()
    previous, pool_module._POOL = pool_module._POOL, fresh
    yield fresh
    fresh.shutdown()
    pool_module._POOL = previous


def _run(names, log_dir, nproc=1, **options):
    result = em.launch(SEEN, nproc=nproc, backend="gloo", namespace={"NAMES": list(names)},
                       log_dir=log_dir, render=lambda e: None, **options)
    return list(result.values.values())


def _write(folder, name, source):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(textwrap.dedent(source))


def test_a_module_a_cell_imported_is_there_before_the_next_cell_starts(pool, log_dir):
    """xml.dom.minidom (nothing of torch's imports it): the first cell imports it; once
    the background rebuild is done, the next cell's workers have it already, and the
    zygote that served the first cell is gone (its workers are)."""
    first = _run(["xml.dom.minidom"], log_dir, nproc=2)
    assert [v["seen"]["xml.dom.minidom"] for v in first] == [False, False]
    assert pool.wait_rebuilt(REBUILD_TIMEOUT)
    assert "xml.dom.minidom" in dict(pool.preload.modules())
    second = _run(["xml.dom.minidom"], log_dir, nproc=2)
    assert [v["seen"]["xml.dom.minidom"] for v in second] == [True, True]
    assert {v["zygote"] for v in second} == set(pool.pids)  # the new one alone is left
    assert not {v["zygote"] for v in first} & set(pool.pids)


def test_ddp_in_a_pooled_worker_imports_no_dynamo(pool, log_dir):
    """DistributedDataParallel's first construction imports torch._dynamo: a pooled
    worker has it before the cell starts; a fresh interpreter does not."""
    cell = textwrap.dedent("""
        import sys
        had = "torch._dynamo" in sys.modules
        import torch
        from torch.nn.parallel import DistributedDataParallel
        DistributedDataParallel(torch.nn.Linear(2, 2))
        (had, "torch._dynamo" in sys.modules)
    """)
    pooled = em.launch(cell, nproc=2, backend="gloo", log_dir=log_dir, render=lambda e: None)
    fresh = em.launch(cell, nproc=1, backend="gloo", log_dir=log_dir, render=lambda e: None,
                      pool=False)
    assert set(pooled.values.values()) == {(True, True)}
    assert fresh.values == {0: (False, True)}


def test_a_module_of_the_users_folder_is_never_learned_nor_imported_by_the_pool(
        pool, log_dir, tmp_path, monkeypatch):
    """The cwd is a folder named site-packages on sys.path (the pool's own test of an
    installation folder would trust it): a module there is imported by the cells that
    import it, never reported, never imported by a zygote, even when named."""
    cwd = tmp_path / "site-packages"
    marks = tmp_path / "imported-by"
    _write(cwd, "users_module", f"""
        with open("/proc/self/comm") as comm, open({str(marks)!r}, "a") as marks:
            marks.write(comm.read())
    """)
    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(cwd))
    for _ in range(2):
        assert [v["seen"]["users_module"] for v in _run(["users_module"], log_dir)] == [False]
        assert pool.wait_rebuilt(REBUILD_TIMEOUT)
    assert "users_module" not in dict(pool.preload.modules())
    _run(["users_module"], log_dir, preload="users_module")
    assert pool.wait_rebuilt(REBUILD_TIMEOUT)
    assert "not in the standard library or site-packages" in \
        pool.preload.left_out["users_module"]
    assert "em-zygote" not in marks.read_text().split()
    assert len(marks.read_text().split()) == 3  # the three cells' workers


def test_a_module_that_starts_a_thread_is_left_out_and_shown(pool, log_dir, tmp_path,
                                                             monkeypatch, ip, capsys):
    """Forking a process with threads is unsafe: a learned module that starts one when
    imported taints the zygote being built, which is dropped; the pool goes on with the
    one it had, remembers why, and `%elastic status` says so. A module that fails to
    import, or ends the zygote, when imported there is left out too."""
    packages = tmp_path / "lib" / "site-packages"
    _write(packages, "starts_a_thread", """
        import threading, time
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    """)
    _write(packages, "fails_in_the_pool", """
        with open("/proc/self/comm") as comm:
            if comm.read().strip() == "em-zygote":
                raise RuntimeError("not here")
    """)
    _write(packages, "ends_the_pool", """
        import os
        with open("/proc/self/comm") as comm:
            if comm.read().strip() == "em-zygote":
                os._exit(3)
    """)
    monkeypatch.syspath_prepend(str(packages))
    ip.run_cell_magic("elastic", "--nproc 1 --backend gloo --text",
                      "import starts_a_thread, fails_in_the_pool, ends_the_pool")
    assert pool.wait_rebuilt(REBUILD_TIMEOUT)
    (served,) = pool.pids
    assert "thread" in pool.preload.left_out["starts_a_thread"]
    assert "RuntimeError: not here" in pool.preload.left_out["fails_in_the_pool"]
    assert "stopped the pool while it imported it" in pool.preload.left_out["ends_the_pool"]
    (value,) = _run(["starts_a_thread", "fails_in_the_pool", "ends_the_pool"], log_dir)
    assert value["seen"] == {"starts_a_thread": False, "fails_in_the_pool": False,
                             "ends_the_pool": False}
    assert pool.pids == [served] and not pool.rebuilding  # nothing more to build
    capsys.readouterr()
    ip.run_line_magic("elastic", "status")
    shown = capsys.readouterr().out
    assert "left out starts_a_thread: starts 1 thread(s) when imported" in shown
    assert "left out fails_in_the_pool: fails to import: RuntimeError" in shown


def test_preload_names_modules_for_the_pool(pool, log_dir):
    """The first job's zygote is built with the modules it names (a later job's names
    come with a background rebuild); a bad name, or --preload with --no-pool, is refused
    before anything starts."""
    assert "wave" not in sys.modules  # nor in the zygote: it imports what the kernel does
    (value,) = _run(["wave"], log_dir, preload="wave,xml.sax.saxutils")
    assert value["seen"]["wave"]
    assert {"wave", "xml.sax.saxutils"} <= dict(pool.preload.modules()).keys()
    with pytest.raises(em.SpecError, match="not a module name"):
        em.JobSpec.create(1, preload="wave,1bad")
    with pytest.raises(em.SpecError, match="--no-pool"):
        em.JobSpec.create(1, preload="wave", pool=False)


def test_a_rebuild_never_holds_up_a_cell(pool, log_dir, tmp_path, monkeypatch):
    """While the successor is still importing (a module that waits, in a zygote only,
    for a gate to open), a cell starts at once from the zygote it has; once the gate
    opens, the successor takes over."""
    packages = tmp_path / "site-packages"
    gate = tmp_path / "gate"
    _write(packages, "slow_in_the_pool", f"""
        import os, time
        with open("/proc/self/comm") as comm:
            in_pool = comm.read().strip() == "em-zygote"
        while in_pool and not os.path.exists({str(gate)!r}):
            time.sleep(0.05)
    """)
    monkeypatch.syspath_prepend(str(packages))
    first = _run(["slow_in_the_pool"], log_dir)
    assert pool.rebuilding
    during = _run(["slow_in_the_pool"], log_dir)
    assert pool.rebuilding and not during[0]["seen"]["slow_in_the_pool"]
    assert during[0]["zygote"] == first[0]["zygote"]
    gate.touch()
    assert pool.wait_rebuilt(REBUILD_TIMEOUT)
    (after,) = _run(["slow_in_the_pool"], log_dir)
    assert after["seen"]["slow_in_the_pool"] and after["zygote"] != first[0]["zygote"]
    assert pool.pids == [after["zygote"]]


@pytest.mark.unit
def test_only_the_interpreters_own_files_are_trusted(tmp_path):
    """The rule the worker reports by and the zygote imports by."""
    site = tmp_path / "venv" / "lib" / "site-packages"
    roots = imports.trusted_roots([str(site), str(tmp_path / "mine")])
    assert str(site) in roots and str(tmp_path / "mine") not in roots
    module = str(site / "pkg" / "__init__.py")
    assert imports.is_trusted(module, roots, cwd=str(tmp_path))  # a project's own venv
    assert not imports.is_trusted(module, roots, cwd=str(site))  # cwd inside: the user's
    assert not imports.is_trusted(str(tmp_path / "mine" / "m.py"), roots, str(tmp_path))
    assert not imports.is_trusted("relative/m.py", roots, str(tmp_path))
    assert imports.is_trusted("built-in", roots, str(tmp_path))
    assert imports.origin_of(os.path, "os.path") is None  # an alias of posixpath
    assert imports.origin_of(textwrap, "textwrap") == textwrap.__file__


def test_a_module_that_leaves_a_file_open_or_reads_the_rank_is_left_out(
        pool, log_dir, tmp_path, monkeypatch):
    """A forked worker has none of the zygote's descriptors (the cell's next open() would
    reuse the number a module's file object holds) and none of its rank (a module that
    reads RANK when imported keeps the zygote's answer): a learned module that does either
    taints the zygote being built and is left out, with its package's other modules;
    without the pool, each rank reads its own RANK."""
    packages = tmp_path / "lib" / "site-packages"
    _write(packages, "keeps_a_file", f"""
        LOG = open({str(tmp_path / "library.log")!r}, "a")
    """)
    _write(packages / "rank_reader", "__init__", """
        import os
        RANK = int(os.environ.get("RANK", "0"))
    """)
    _write(packages / "rank_reader", "helpers", "")
    monkeypatch.syspath_prepend(str(packages))
    cell = textwrap.dedent("""
        import os, keeps_a_file, rank_reader, rank_reader.helpers
        mine = open(os.devnull)  # takes the lowest free descriptor
        held = os.readlink(f"/proc/self/fd/{keeps_a_file.LOG.fileno()}")
        mine.close()
        (held, rank_reader.RANK)
    """)
    for _ in range(2):
        result = em.launch(cell, nproc=2, backend="gloo", log_dir=log_dir,
                           render=lambda e: None)
        assert result.values == {0: (str(tmp_path / "library.log"), 0),
                                 1: (str(tmp_path / "library.log"), 1)}
        assert pool.wait_rebuilt(REBUILD_TIMEOUT)
    assert "leaves 1 file(s) open when imported" in pool.preload.left_out["keeps_a_file"]
    assert "library.log" in pool.preload.left_out["keeps_a_file"]
    assert pool.preload.left_out["rank_reader"].startswith("reads RANK when imported")
    learned = dict(pool.preload.modules())
    assert not {"keeps_a_file", "rank_reader", "rank_reader.helpers"} & learned.keys()
    (value,) = _run(["keeps_a_file", "rank_reader"], log_dir)
    assert value["seen"] == {"keeps_a_file": False, "rank_reader": False}


def test_lightning_is_preloaded_and_each_rank_keeps_its_own_rank(pool, log_dir):
    """lightning_fabric sets rank_zero_only.rank from RANK when imported, torchmetrics its own
    from LOCAL_RANK: once the pool has learned them, they are there before the cell starts
    (a new rank no longer imports Lightning: 0.3 s here), and rank 1 is still rank 1."""
    pytest.importorskip("pytorch_lightning")
    cell = textwrap.dedent("""
        import sys
        there = {m: m in sys.modules for m in ("pytorch_lightning", "torchmetrics")}
        import pytorch_lightning
        from lightning_fabric.utilities.rank_zero import rank_zero_only
        from torchmetrics.utilities import prints
        there, rank_zero_only.rank, prints.rank_zero_only.rank
    """)
    for learned in (False, True):
        result = em.launch(cell, nproc=2, backend="gloo", log_dir=log_dir,
                           render=lambda e: None)
        there = {"pytorch_lightning": learned, "torchmetrics": learned}
        assert result.values == {0: (there, 0, 0), 1: (there, 1, 1)}
        assert pool.wait_rebuilt(REBUILD_TIMEOUT)
    assert not {"pytorch_lightning", "lightning_fabric", "torchmetrics"} & set(
        pool.preload.left_out)


@pytest.mark.unit
def test_a_rank_read_is_excused_only_where_each_rank_sets_the_answer_again():
    """Which module reads is the one whose code asked (through os.environ.get, os.getenv or
    ``in``): Lightning's rank_zero module may read RANK, torchmetrics' prints LOCAL_RANK, and
    nothing else; the reason names the module."""
    def read(module: str, code: str) -> list[str]:
        with import_checks.watched() as unsafe:
            exec(code, {"__name__": module, "os": os})
        return unsafe

    assert read("lightning_fabric.utilities.rank_zero",
                "os.environ.get('RANK'); os.getenv('LOCAL_RANK')") == []
    assert read("torchmetrics.utilities.prints", "'LOCAL_RANK' in os.environ") == []
    (why,) = read("torchmetrics.utilities.prints", "os.environ.get('RANK')")
    assert why.startswith("reads RANK when imported (in torchmetrics.utilities.prints;")
    (why,) = read("some_library", "os.getenv('WORLD_SIZE')")
    assert "(in some_library;" in why
    # a module that caches what Lightning's function reads for it is the one that reads
    (why,) = read("caches_the_rank", "from lightning_fabric.utilities import rank_zero\n"
                                     "RANK = rank_zero._get_rank()")
    assert "(in caches_the_rank;" in why


@pytest.mark.unit
def test_the_checks_see_files_left_open_and_per_round_reads(tmp_path):
    """The zygote's checks themselves, in this process: a file left open and a rank read
    (through os.environ, os.getenv, or a kept reference) are seen; a file closed again, or
    another variable read, is not."""
    with import_checks.watched() as unsafe:
        with open(tmp_path / "closed", "w"):
            pass
        os.environ.get("HOME")
    assert unsafe == []
    with import_checks.watched() as unsafe:
        kept = os.environ
        os.getenv("LOCAL_RANK")
        "TORCHELASTIC_RUN_ID" in os.environ  # noqa: B015
        left = open(tmp_path / "open", "w")  # noqa: SIM115
    try:
        assert any(why.startswith("leaves 1 file(s) open") for why in unsafe)
        assert any(why.startswith("reads LOCAL_RANK, TORCHELASTIC_RUN_ID") for why in unsafe)
    finally:
        left.close()
    assert os.environ is not kept and kept.get("HOME") == os.environ.get("HOME")


def test_the_pool_forgets_what_it_learned(pool, log_dir, ip, capsys):
    """`%elastic pool forget`: the learned modules and those left out are forgotten; the
    next job's zygote is a new one with the defaults only. Anything else is refused."""
    _run(["xml.dom.minidom"], log_dir)
    assert pool.wait_rebuilt(REBUILD_TIMEOUT)
    pool.preload.leave_out("some_module", "a reason")
    served = pool.pids
    ip.run_line_magic("elastic", "pool forget")
    assert "forgot" in capsys.readouterr().out
    assert not pool.preload.left_out
    assert "xml.dom.minidom" not in dict(pool.preload.modules())
    (value,) = _run(["xml.dom.minidom"], log_dir)
    assert not value["seen"]["xml.dom.minidom"] and value["zygote"] not in served
    with pytest.raises(UsageError, match="pool forget"):
        ip.run_line_magic("elastic", "pool")


def test_modules_an_earlier_one_imports_are_not_kept_on_the_list(pool, log_dir, tmp_path,
                                                                 monkeypatch):
    """A package's import brings its submodules: the worker reports each (hundreds, for a
    big package), the zygote says which came with an earlier one, and the list keeps only
    the others; the next cell still has them all."""
    packages = tmp_path / "site-packages"
    _write(packages / "big_package", "__init__", "from . import one, two, three")
    for name in ("one", "two", "three"):
        _write(packages / "big_package", name, "")
    monkeypatch.syspath_prepend(str(packages))
    names = ["big_package.one", "big_package.two", "big_package.three"]
    _run(["big_package"], log_dir)
    assert set(names) <= dict(pool.preload.modules()).keys()  # as the worker reported
    assert pool.wait_rebuilt(REBUILD_TIMEOUT)
    assert len(set(names) & dict(pool.preload.modules()).keys()) == 1
    (value,) = _run(names, log_dir)
    assert all(value["seen"].values())
