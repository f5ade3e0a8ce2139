"""``%%elastic``: parse flags, build the payload, run the job, put results in the kernel."""

from __future__ import annotations

import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .agent.job import Job
from .api import build_payload
from .events import JobState
from .payload import PayloadError, uses_ipython_syntax
from .result import JobFailedError, JobResult
from .spec import JobSpec, SpecError
from .ui.text import TextRenderer


@magics_class
class ElasticMagics(Magics):
    @magic_arguments()
    @argument("--nproc", default=None,
              help="workers on this machine: N, auto, cpu or gpu "
                   "(default: one per GPU, or 1 without GPUs)")
    @argument("--max-restarts", type=int, default=0,
              help="restarts of the whole group after a failure (default 0)")
    @argument("--monitor-interval", type=float, default=0.1,
              help="seconds between health checks of the workers (default 0.1)")
    @argument("--backend", default="auto",
              help="process-group backend: auto (nccl with CUDA, else gloo), gloo or nccl")
    @argument("--no-init", action="store_true",
              help="do not call init_process_group for the cell; it does so itself")
    @argument("--log-dir", default=None,
              help="where full per-rank logs go (default: a folder in the temp dir)")
    @argument("--timeout", type=float, default=300.0,
              help="seconds workers wait for each other: rendezvous and collectives")
    @argument("--env", action="append", default=[], metavar="K=V",
              help="set an environment variable in the workers (repeatable)")
    @argument("--args", default="", help='the cell\'s sys.argv[1:], as one string: "--lr 0.1"')
    @argument("-o", "--out", default=None, metavar="NAME",
              help="store the JobResult in this kernel variable (also on failure)")
    @argument("--pull", default="", metavar="NAMES",
              help="after success, copy these variables (comma-separated) from rank 0")
    @cell_magic
    def elastic(self, line: str, cell: str) -> Any:
        """Run the cell as an elastic distributed PyTorch job on local worker processes.

        Each worker is a fresh Python interpreter with torchrun's environment (RANK,
        LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...); the process group is initialised for
        the cell unless --no-init. Kernel variables the cell reads are sent to every
        worker. Each rank's output appears with a [rank N] prefix; the cell's last
        expression is each rank's value (JobResult.values). A failed rank stops the whole
        group at once; with --max-restarts the group starts again.

        Example::

            %%elastic --nproc 2 --max-restarts 1 -o job
            import torch, torch.distributed as dist
            t = torch.ones(1) * dist.get_rank()
            dist.all_reduce(t)
            t.item()
        """
        try:
            opts = parse_argstring(self.elastic, line)
        except ValueError as exc:  # shlex: unbalanced quotes in the flags
            raise UsageError(f"%%elastic {line}: {exc}; check the quotes.") from None
        spec = self._spec(opts)
        payload = self._payload(cell, spec)
        job = Job(spec, payload).start()
        try:
            result = job.wait(TextRenderer())
        finally:
            # On interrupt too, the user gets the record of what ran.
            if opts.out and job.result is not None:
                self.shell.user_ns[opts.out] = job.result
        return self._deliver(result)

    def _spec(self, opts: Any) -> JobSpec:
        for name in (opts.out,):
            if name is not None and not name.isidentifier():
                raise UsageError(f"-o/--out {name!r}: not a Python variable name.")
        try:
            argv = shlex.split(opts.args)
        except ValueError as exc:
            raise UsageError(f"--args {opts.args!r}: {exc}; quote it as one string.") from None
        pull = [n.strip() for n in opts.pull.replace(" ", ",").split(",") if n.strip()]
        try:
            return JobSpec.create(
                opts.nproc, backend=opts.backend, max_restarts=opts.max_restarts,
                monitor_interval=opts.monitor_interval, timeout=opts.timeout,
                init_process_group=not opts.no_init, log_dir=opts.log_dir, env=opts.env,
                args=argv, pull=pull,
            )
        except SpecError as exc:
            raise UsageError(f"%%elastic: {exc}") from None

    def _payload(self, cell: str, spec: JobSpec) -> Any:
        if uses_ipython_syntax(self.shell.transform_cell(cell)):
            raise UsageError(
                "%%elastic: IPython syntax (%magics, !shell, ?help) cannot run in workers, "
                "which are plain Python. Move it to a cell of its own."
            )
        try:
            return build_payload(cell, spec, namespace=self.shell.user_ns)
        except PayloadError as exc:
            raise UsageError(f"%%elastic: {exc}") from None

    def _deliver(self, result: JobResult) -> JobResult | None:
        if result.state is JobState.FAILED:
            raise JobFailedError(result)
        self.shell.user_ns.update(result.pulled)
        if result.missing_pulls:
            raise UsageError(
                f"--pull: rank 0 has no variable named {', '.join(result.missing_pulls)} "
                "after the cell ran; the job itself succeeded."
            )
        # Like IPython's own cells: show a value only when the cell produced one.
        return result if any(v is not None for v in result.values.values()) else None
