"""A notebook day in one real kernel: many cells of every kind (dashboard, failure,
background), under a lowered open-file limit; what the kernel holds stays flat."""

from __future__ import annotations

import json
import os

import pytest
from conftest import tagged_workers
from jupyter_client.manager import start_new_kernel
from test_kernel import execute

pytestmark = pytest.mark.soak

# CI runs 60 cells (about 2.5 minutes on 2 cores); ELASTIC_MAGIC_SOAK_CELLS=500 is the
# notebook day the closing notes report. A leak of one descriptor a cell shows either way.
CELLS = int(os.environ.get("ELASTIC_MAGIC_SOAK_CELLS", "60"))
WARM_UP = 24  # lazy imports, the widget machinery, thread pools: counted from here
FD_LIMIT = 256  # the old registry leaked 18 descriptors a cell: dead by cell 12

SETUP = f"""
import json, resource, threading, psutil
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, ({FD_LIMIT}, hard))
%load_ext elastic_magic
big = b"x" * (50 << 20)  # every cell ships it: a kept payload would show in the RSS
def usage():  # no gc.collect(): what only the collector frees is what runs a kernel dry
    for thread in threading.enumerate():  # a background job's view may still be closing
        if thread.name.startswith("elastic-view-"):
            thread.join(10)
    me = psutil.Process()
    return json.dumps(dict(fds=me.num_fds(), threads=threading.active_count(),
                           connections=len(me.net_connections("inet")),
                           rss_mb=me.memory_info().rss / 2**20,
                           jobs=len(get_ipython().magics_manager.registry["ElasticMagics"].jobs)))
"""

CELL_KINDS = (
    # the dashboard path (a kernel renders widgets) with a collective
    "%%elastic --nproc 2\nimport torch, torch.distributed as dist\n"
    "t = torch.ones(1)\ndist.all_reduce(t)\nlen(big) + t.item()\n",
    # a failure with its root cause
    "%%elastic --nproc 1 --text\nraise ValueError(f'bad {len(big)}')\n",
    # a background job, waited for in the next request
    "%%elastic --nproc 1 --bg -o bg\nlen(big)\n",
)


def _usage(kc) -> dict:
    reply, text = execute(kc, "print(usage())")
    assert reply["status"] == "ok", text
    return json.loads(text.strip().splitlines()[-1])


@pytest.mark.timeout(1800)
def test_hundreds_of_cells_keep_the_kernel_flat():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        reply, text = execute(kc, SETUP)
        assert reply["status"] == "ok", text
        baseline = None
        for n in range(CELLS):
            kind = n % len(CELL_KINDS)
            reply, text = execute(kc, CELL_KINDS[kind])
            if kind == 1:
                assert reply["status"] == "error" and "ValueError: bad 52428800" in text, (n, text)
            else:
                assert reply["status"] == "ok", f"cell {n}: {text}"
            if kind == 2:
                reply, text = execute(kc, "assert bg.wait_done(120) and bg.result.value == "
                                          "len(big), bg.result")
                assert reply["status"] == "ok", f"cell {n}: {text}"
            if n + 1 == WARM_UP:
                baseline = _usage(kc)
        end = _usage(kc)
        print(f"after {WARM_UP} cells: {baseline}\nafter {CELLS} cells: {end}")  # with -s
        assert baseline is not None
        assert end["fds"] <= baseline["fds"] + 2, (baseline, end)
        assert end["threads"] <= baseline["threads"], (baseline, end)
        assert end["connections"] <= baseline["connections"], (baseline, end)
        assert end["rss_mb"] - baseline["rss_mb"] < 40, (baseline, end)
        assert end["jobs"] <= 100, "the jobs history is bounded"
        reply, text = execute(kc, "%elastic jobs")
        assert reply["status"] == "ok" and len(text.splitlines()) == end["jobs"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert not tagged_workers()
