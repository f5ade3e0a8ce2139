"""The agent's loop, modelled on torch's SimpleElasticAgent but ours: it runs on a kernel
thread (no signal handlers), emits the events renderers need, and gives every attempt a
fresh store namespace so restarts always work."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from ..events import (
    AcceptingNodes,
    Committed,
    EventSink,
    JobFinished,
    JobState,
    MembershipChanged,
    NodeConnected,
    Output,
    RendezvousCompleted,
    ResizeRequested,
    Restarting,
    StateChanged,
    WorkerFailed,
    WorkersStarted,
)
from ..logs import rank_dir
from ..payload import Payload
from ..protocol import handoff, new_secret
from ..result import JobResult, RankFailure, Unpicklable, root_cause_order
from ..spec import JobSpec
from . import workers as wk
from .hub import HUB_KEY, Hub, Link, LinkMessage
from .rendezvous import Rendezvous, RoundInfo
from .snapshots import SnapshotStore
from .workers import Worker, WorkerReport, WorkerState

_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


def _is_installed() -> bool:
    try:
        importlib.metadata.distribution("elastic-magic")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


_INSTALLED = _is_installed()
# A worker that exited without its channel closing (a forked grandchild holds the pipe)
# is judged on its exit code after this long.
_CHANNEL_CLOSE_GRACE = 1.0
_EXIT_AFTER_RESULTS_TIMEOUT = 30.0
# Multi-node: how often to ask the rendezvous for waiting machines, and how long a group with
# State may take to reach its next commit (and leave there, losing no step) before it is
# stopped for the new round anyway.
_WAITING_CHECK_INTERVAL = 0.5
_GRACEFUL_REGROUP_WAIT = 10.0


@dataclass(frozen=True)
class StopCommand:
    reason: str = "stopped"


@dataclass(frozen=True)
class ScaleCommand:
    nproc: int
    immediate: bool = False


@dataclass(frozen=True)
class JoinedJob:
    """How an agent on another machine (a node) takes part in the head's job."""

    link: Link  # to the head's hub
    rdzv_endpoint: str  # the rendezvous store the head hosts
    host: str  # this machine's address as the others reach it


def join_command(endpoint: str, token: str) -> str:
    return f"elastic-magic join {endpoint} --token {token}"


class Agent:
    """Supervises one job: rendezvous, start, monitor, restart, finish."""

    def __init__(
        self, spec: JobSpec, payload: Payload, run_id: str, emit: EventSink,
        inbox: queue.Queue[Any], *, token: str | None = None, joined: JoinedJob | None = None,
    ) -> None:
        self.spec = spec
        self.token = token  # the head of a multi-node job: what nodes must prove
        self.joined = joined  # set on a node: the agent follows the head's job
        self.payload = payload
        self.run_id = run_id
        self.emit = emit
        self.inbox = inbox
        self.key = new_secret()
        self.log_root = spec.log_dir / run_id
        self.restart_count = 0
        self.attempt = -1
        self.world_size = 0
        self.group: list[Worker] = []
        self.failures: list[RankFailure] = []
        self.stop_reason: str | None = None
        self.state = JobState.RENDEZVOUS
        self.started = time.time()
        self.nproc = spec.nproc  # workers on this machine; changed by resizes
        self.pending_resize: int | None = None
        self.resizes = 0
        self.uses_state = False  # a worker asked for the elastic State
        self.snapshots = SnapshotStore(spec.checkpoint_dir)
        self.rendezvous: Rendezvous | None = None
        self.hub: Hub | None = None
        self.round: RoundInfo | None = None
        self.node_results: dict[str, dict[int, dict[str, Any]]] = {}  # round id -> node rank
        self.join_command: str | None = None  # set once other machines can join
        self.node_names: dict[int, str] = {}  # hub connection -> the machine's address
        self.terminal_failure = False  # another machine failed for good: no restart here
        self._next_waiting_check = 0.0
        self._regroup_by: float | None = None

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> JobResult:
        final = JobState.FAILED
        try:
            self._set_state(JobState.RENDEZVOUS)
            if self.snapshots.load_checkpoint():
                meta = self.snapshots.meta or {}
                self.emit(Committed(meta.get("step"), meta.get("world_size", 0),
                                    self.snapshots.size, origin="checkpoint"))
            self.rendezvous = self._open_rendezvous()
            while True:
                if self._drain_inbox() == "stop":
                    final = JobState.STOPPED
                    break
                self._apply_pending_resize()
                info = self._next_round()
                if info is None:
                    final = JobState.STOPPED
                    break
                self.emit(RendezvousCompleted(
                    info.round, info.node_rank, info.nnodes, info.world_size,
                    info.master_addr, info.master_port,
                ))
                self._start_group(info)
                final = self._monitor()
                if final is JobState.RESIZING:  # a membership change, not a restart
                    self._set_state(JobState.RENDEZVOUS)
                    continue
                if final is JobState.SUCCEEDED:
                    final = self._finish_round(info)
                if final is not JobState.FAILED or self.terminal_failure \
                        or self.restart_count >= self.spec.max_restarts:
                    break
                self.restart_count += 1
                self._set_state(JobState.RESTARTING)
                self.emit(Restarting(self.restart_count, self.spec.max_restarts, self.failures[0]))
                self._set_state(JobState.RENDEZVOUS)
        except BaseException:
            final = JobState.FAILED
            raise
        finally:
            wk.stop(self.group, wk.TEARDOWN_ESCALATION)
            wk.join_threads(self.group)
            if self.rendezvous is not None:
                # A node leaves the rendezvous open: the job belongs to the head.
                self.rendezvous.close(shutdown=self.joined is None)
            result = self._result(final)
            self._set_state(final)
            self._tell_peers(final)
            self.emit(JobFinished(result))
        return result

    def _next_round(self) -> RoundInfo | None:
        """Join the next round. That can take long (machines are awaited), so it runs on a
        helper thread while this one serves stop requests. None when a stop came first, or
        when a node finds that the job has ended."""
        rendezvous = self.rendezvous
        assert rendezvous is not None
        outcome: queue.Queue[tuple[RoundInfo | None, BaseException | None]] = queue.Queue()

        def join() -> None:
            try:
                outcome.put((rendezvous.next_round(self.nproc), None))
            except BaseException as exc:
                outcome.put((None, exc))

        helper = threading.Thread(target=join, name=f"elastic-rendezvous-{self.run_id}",
                                  daemon=True)
        helper.start()
        while True:
            try:
                info, error = outcome.get(timeout=self.spec.monitor_interval)
                break
            except queue.Empty:
                if self._drain_inbox() == "stop":
                    if self.joined is None:  # the job is over for every machine
                        rendezvous.cancel()
                        helper.join(timeout=10)
                    return None
        if isinstance(error, RendezvousClosedError) and self.joined is not None:
            self.stop_reason = "the job ended before this machine joined a round"
            return None
        if error is not None:
            raise error
        self.round = info
        return info

    def _open_rendezvous(self) -> Rendezvous:
        spec = self.spec
        if self.joined is not None:
            return Rendezvous(self.run_id, host=self.joined.host, join=self.joined.rdzv_endpoint,
                              min_nodes=spec.min_nodes, max_nodes=spec.max_nodes,
                              join_timeout=spec.timeout)
        rendezvous = Rendezvous(self.run_id, host=spec.rdzv_host, port=spec.rdzv_port,
                                min_nodes=spec.min_nodes, max_nodes=spec.max_nodes,
                                join_timeout=spec.timeout)
        if spec.multi_node:
            assert self.token is not None
            job = {"run_id": self.run_id, "spec": spec, "payload": self.payload}
            self.hub = Hub(spec.rdzv_host, self.token, job, self.inbox)
            rendezvous.store.set(HUB_KEY, self.hub.address)
            self.join_command = join_command(rendezvous.endpoint, self.token)
            self.emit(AcceptingNodes(rendezvous.endpoint, self.join_command))
        return rendezvous

    def _tell_peers(self, final: JobState) -> None:
        """The head ends every node with the job; a node tells the head how it ended."""
        if self.hub is not None:
            self.hub.broadcast(("stop", f"the job {final.value}"))
            self.hub.close()
        if self.joined is not None:
            self.joined.link.send(("finished", {"state": final, "failures": self.failures}))

    def _set_state(self, state: JobState) -> None:
        if state is not self.state or state is JobState.RENDEZVOUS:
            self.state = state
            self.emit(StateChanged(state))

    def _drain_inbox(self) -> str | None:
        """Handle queued items without waiting; "stop" or "resize" when one must act."""
        action = None
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return action
            action = self._handle(item) or action
            if action == "stop":
                return action

    def _handle(self, item: Any) -> str | None:
        if isinstance(item, StopCommand):
            self.stop_reason = item.reason
            if self.joined is not None:  # before our ranks go: a membership change there
                self.joined.link.send(("leaving", item.reason))
            return "stop"
        if isinstance(item, ScaleCommand):
            return self._request_resize(item)
        if isinstance(item, WorkerReport) and item.attempt == self.attempt:
            self._on_report(self.group[item.local_rank], item)
        if isinstance(item, LinkMessage):
            return self._from_node(item) if self.joined is None else self._from_head(item)
        return None

    # -- other machines ------------------------------------------------------------------

    def _from_node(self, message: LinkMessage) -> str | None:
        """The head: a frame from a node (its output, its workers' State requests, its
        results, how it ended)."""
        kind, body = message.kind, message.body
        if kind == "hello":
            self.node_names[message.node] = body["host"]
            self.emit(NodeConnected(body["host"], body["nproc"], True))
        elif kind == "event":  # its ranks' output belongs to our current attempt here
            self.emit(dataclasses.replace(body, attempt=self.attempt)
                      if isinstance(body, Output) else body)
        elif kind == "request":
            # Its workers cannot read our memory files: snapshots go inline.
            value = self._serve_state(body["kind"], {**body["body"], "inline": True})
            message.link.send(("reply", {**body, "body": None, "value": value}))
        elif kind == "group_result":
            self.node_results.setdefault(body["round_id"], {})[body["node_rank"]] = body
        elif kind == "finished" and body["state"] is JobState.FAILED and body["failures"]:
            self.failures = root_cause_order([*self.failures, *body["failures"]])
            self.terminal_failure = True  # that machine has no restarts left: the job ends
            return "node_failed"
        elif kind == "leaving":  # its ranks are about to go: regroup without them
            self._node_left(message.node)
            return "resize"
        elif kind == "closed":
            self._node_left(message.node)
        return None

    def _node_left(self, node: int) -> None:
        if node in self.node_names:
            self.emit(NodeConnected(self.node_names.pop(node), 0, False))

    def _from_head(self, message: LinkMessage) -> str | None:
        """A node: a frame from the head (answers for our workers, regroup, stop)."""
        kind, body = message.kind, message.body
        if kind == "reply":
            if body["attempt"] == self.attempt and body["local_rank"] < len(self.group):
                self.group[body["local_rank"]].send(
                    ("reply", {"request_id": body["request_id"], "value": body["value"]}))
        elif kind == "regroup":
            return "resize"
        elif kind == "stop":
            self.stop_reason = body
            return "stop"
        elif kind == "closed":
            self.stop_reason = "the head of the job (the notebook's kernel) went away"
            return "stop"
        return None

    def _nodes_waiting(self) -> bool:
        return self.spec.multi_node and self.rendezvous is not None \
            and self.rendezvous.num_nodes_waiting() > 0

    def _regroup_due(self) -> bool:
        """torch's waiting-node mechanism: when a machine waits for the next round (one
        joining, or one that left its group to resize or restart), every node leaves its
        group and re-rendezvous. With State, the group first gets the chance to leave at its
        next commit, which the head answers with "resize" while machines wait."""
        now = time.monotonic()
        if not self.spec.multi_node or now < self._next_waiting_check:
            return False
        self._next_waiting_check = now + _WAITING_CHECK_INTERVAL
        if not self._nodes_waiting():
            self._regroup_by = None
            return False
        if self._regroup_by is None:
            graceful = self.uses_state and self.state is JobState.RUNNING
            self._regroup_by = now + (_GRACEFUL_REGROUP_WAIT if graceful else 0.0)
        return now >= self._regroup_by

    def _finish_round(self, info: RoundInfo) -> JobState:
        """The local group succeeded. A node reports its ranks' results to the head; the
        head waits for every other node's results of this round."""
        if self.joined is not None:
            self.joined.link.send(("group_result", {
                "round_id": info.round_id, "node_rank": info.node_rank,
                "results": {w.global_rank: w.result for w in self.group},
                "tails": {w.global_rank: list(w.tail) for w in self.group},
            }))
            return JobState.SUCCEEDED
        deadline = time.monotonic() + self.spec.timeout
        while len(self.node_results.get(info.round_id, {})) < info.nnodes - 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the other machines did not report their results within "
                                   f"{self.spec.timeout:.0f}s")
            try:
                action = self._handle(self.inbox.get(timeout=self.spec.monitor_interval))
            except queue.Empty:
                continue
            if action == "stop":
                return JobState.STOPPED
            if action == "node_failed":
                return JobState.FAILED
        return JobState.SUCCEEDED

    # -- resizing ------------------------------------------------------------------------

    def _request_resize(self, command: ScaleCommand) -> str | None:
        if command.nproc == self.nproc and self.pending_resize is None:
            return None
        self.pending_resize = command.nproc
        graceful = self.uses_state and not command.immediate and self.state is JobState.RUNNING
        self.emit(ResizeRequested(command.nproc, graceful))
        # With a State, the next commit applies it (no step lost); otherwise now.
        return None if graceful else "resize"

    def _apply_pending_resize(self) -> None:
        if self.pending_resize is not None and self.pending_resize != self.nproc:
            old, self.nproc = self.nproc, self.pending_resize
            self.resizes += 1
            self.emit(MembershipChanged(old, self.nproc))
        self.pending_resize = None

    # -- starting ------------------------------------------------------------------------

    def _start_group(self, info: RoundInfo) -> None:
        self.attempt += 1
        self.world_size = info.world_size
        self._regroup_by = None
        self.failures = []
        self._set_state(JobState.STARTING)
        self.group = [
            Worker(local_rank=i, global_rank=info.base_rank + i, attempt=self.attempt)
            for i in range(self.nproc)
        ]
        for worker in self.group:
            env = self._worker_env(worker, info)
            wk.spawn(worker, env=env, cwd=self.payload.cwd, key=self.key,
                     log_root=self.log_root, inbox=self.inbox, emit=self.emit)
            worker.send(("run", self.payload))
        self.emit(WorkersStarted(
            self.attempt, self.restart_count,
            tuple(w.global_rank for w in self.group), tuple(w.pid for w in self.group),
        ))

    def _worker_env(self, worker: Worker, info: RoundInfo) -> dict[str, str]:
        env = dict(os.environ)
        if env.get("MPLBACKEND", "").startswith("module://matplotlib_inline"):
            del env["MPLBACKEND"]  # the inline backend needs a kernel; workers have none
        if "OMP_NUM_THREADS" not in os.environ and self.nproc > 1:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun: workers sharing a machine
        if not _INSTALLED:  # running from a source checkout: workers must find the package
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_PARENT,
                                                              env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"  # lines reach the notebook as they are printed
        assert worker.global_rank is not None
        env.update({
            "RANK": str(worker.global_rank),
            "LOCAL_RANK": str(worker.local_rank),
            "WORLD_SIZE": str(info.world_size),
            "LOCAL_WORLD_SIZE": str(self.nproc),
            "GROUP_RANK": str(info.node_rank),
            "GROUP_WORLD_SIZE": str(info.nnodes),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(worker.global_rank),
            "ROLE_WORLD_SIZE": str(info.world_size),
            "MASTER_ADDR": info.master_addr,
            "MASTER_PORT": str(info.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(self.spec.max_restarts),
            "TORCHELASTIC_RUN_ID": self.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_ERROR_FILE": str(
                rank_dir(self.log_root, self.attempt, worker.global_rank) / "error.json"
            ),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
            ),
        })
        env.update(self.spec.env)
        return env

    # -- monitoring ----------------------------------------------------------------------

    def _monitor(self) -> JobState:
        """Wait until the group succeeds, fails or is stopped; leave no worker running."""
        while True:
            try:
                item = self.inbox.get(timeout=self.spec.monitor_interval)
            except queue.Empty:
                item = None
            action = (self._handle(item) if item is not None else None) or self._drain_inbox()
            if action == "stop":
                return self._stop_group()
            if action == "resize" or self._regroup_due():
                return self._resize_group_now()
            if action == "node_failed":
                return self._stop_for_node_failure()
            self._poll_exits()
            if any(self._has_failed(w) for w in self.group):
                self._teardown_failed_group()
                return JobState.FAILED
            if all(w.state is WorkerState.SUCCEEDED for w in self.group):
                self._release_group()
                return JobState.SUCCEEDED
            if all(w.resized for w in self.group):  # every rank left at the commit
                self._set_state(JobState.RESIZING)
                self._release_group()
                return JobState.RESIZING

    def _on_report(self, worker: Worker, report: WorkerReport) -> None:
        if report.kind == "running":
            worker.running = True
            if all(w.running for w in self.group):
                self._set_state(JobState.RUNNING)
        elif report.kind == "result":
            worker.result = report.body
            worker.state = WorkerState.SUCCEEDED
        elif report.kind == "error":
            worker.error = report.body
            worker.state = WorkerState.FAILED
        elif report.kind == "closed":
            worker.channel_closed_at = report.time
        elif report.kind in ("state_get", "commit"):
            self.uses_state = True
            body = report.body
            if report.kind == "commit" and body["snapshot"] is None:
                body = self._take_snapshot(worker, body)
                if body is None:  # the worker sends it down the pipe instead
                    worker.send(("reply", {"request_id": report.body["request_id"],
                                           "value": {"handoff_failed": True}}))
                    return
            if self.joined is not None:  # the head holds the snapshots
                self.joined.link.send(("request", {
                    "kind": report.kind, "body": body, "local_rank": worker.local_rank,
                    "attempt": self.attempt, "request_id": body["request_id"]}))
            else:
                worker.send(("reply", {"request_id": body["request_id"],
                                       "value": self._serve_state(report.kind, body)}))
        elif report.kind == "resized":
            worker.resized = True
            worker.state = WorkerState.STOPPED

    def _take_snapshot(self, worker: Worker, body: dict[str, Any]) -> dict[str, Any] | None:
        """A commit whose snapshot the worker left in a memory file: the head keeps the
        file; a node reads it into bytes, to cross the network. None if unreadable."""
        fd = wk.take_handoff(worker, body["handoff"])
        if fd is None:
            return None
        if self.joined is None:
            return {**body, "memory_file": fd}
        try:
            return {**body, "snapshot": os.pread(fd, body["handoff"]["size"], 0)}
        finally:
            os.close(fd)

    def _serve_state(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """The head's answer to a rank's State request, from this machine or another."""
        self.uses_state = True
        snapshots = self.snapshots
        if kind == "state_get":
            if snapshots.memory_file is not None and not body.get("inline"):
                # The worker reads our memory file through /proc (or asks again, inline).
                return {"snapshot": None, "handoff": handoff(snapshots.memory_file),
                        "commit_id": snapshots.commit_id}
            return {"snapshot": snapshots.blob, "commit_id": snapshots.commit_id}
        meta = {"step": body["step"], "time": body["time"], "world_size": self.world_size}
        snapshots.commit(meta, data=body.get("snapshot"), fd=body.get("memory_file"))
        self.emit(Committed(body["step"], self.world_size, snapshots.size))
        # Every rank leaves at this commit when this machine resizes or others wait to join.
        resize = (self.pending_resize is not None and self.pending_resize != self.nproc) \
            or self._nodes_waiting()
        if resize:
            self._set_state(JobState.RESIZING)
        return {"resize": resize}

    def _poll_exits(self) -> None:
        now = time.time()
        for worker in self.group:
            code = worker.proc.poll() if worker.proc else None
            if code is None or worker.exited_at is not None:
                continue
            worker.exited_at = now
            if code == 0 and worker.state is WorkerState.HEALTHY and worker.result is None \
                    and not worker.resized:
                # Exited cleanly without a result (os._exit(0) in the cell): success, no value.
                worker.result = {"value": cloudpickle.dumps(None), "pulled": {}, "missing": []}
                worker.state = WorkerState.SUCCEEDED

    def _has_failed(self, worker: Worker) -> bool:
        if worker.error is not None:
            return True
        code = worker.proc.poll() if worker.proc else None
        if code is None or code == 0 or worker.exited_at is None:
            return False
        # Wait for its channel to close so an error report in flight is not missed.
        return worker.channel_closed_at is not None or (
            time.time() - worker.exited_at > _CHANNEL_CLOSE_GRACE
        )

    def _teardown_failed_group(self) -> None:
        """Stop the survivors at once (no waiting for collective timeouts), then sort out
        who failed on their own (before the teardown) and who was stopped by it."""
        teardown_at = time.time()
        self._set_state(JobState.STOPPING)
        wk.stop(self.group, wk.TEARDOWN_ESCALATION)
        wk.join_threads(self.group, timeout=2.0)
        self._drain_inbox()
        self._poll_exits()
        failures = [
            self._failure(w) for w in self.group
            if (w.error is not None and w.error["time"] <= teardown_at)
            or (w.error is None and w.exited_at is not None and w.exited_at <= teardown_at
                and w.proc is not None and w.proc.returncode != 0)
        ]
        for worker in self.group:
            worker.state = WorkerState.FAILED if worker.error else WorkerState.STOPPED
        self.failures = root_cause_order(failures)
        for failure in self.failures:
            self.emit(WorkerFailed(failure))

    def _failure(self, worker: Worker) -> RankFailure:
        code = worker.proc.returncode if worker.proc else None
        common = dict(
            rank=worker.global_rank, local_rank=worker.local_rank, attempt=self.attempt,
            pid=worker.pid, log_dir=str(worker.log_dir),
        )
        if worker.error is not None:
            info = dict(worker.error)
            return RankFailure(**common, **info)
        when = worker.channel_closed_at or worker.exited_at or time.time()
        if code is not None and code < 0:
            return RankFailure(**common, time=when, signal=_signal_name(-code), exit_code=code)
        return RankFailure(**common, time=when, exit_code=code)

    def _stop_group(self) -> JobState:
        """A stop request (Stop button, kernel interrupt): SIGINT, SIGTERM, then SIGKILL.
        Other machines hear first, so their ranks stop rather than fail on lost peers."""
        self._set_state(JobState.STOPPING)
        if self.hub is not None:
            self.hub.broadcast(("stop", self.stop_reason))
        wk.stop(self.group, wk.INTERRUPT_ESCALATION)
        wk.join_threads(self.group, timeout=2.0)
        for worker in self.group:
            if worker.state is not WorkerState.SUCCEEDED:
                worker.state = WorkerState.STOPPED
        return JobState.STOPPED

    def _resize_group_now(self) -> JobState:
        """An immediate resize or regroup: stop the group; the next round resumes from the
        last commit. The head first tells the nodes, so that their ranks, which lose peers
        now, are stopped as a membership change rather than failing."""
        if self.hub is not None:
            self.hub.broadcast(("regroup", None))
        self._set_state(JobState.RESIZING)
        self._stop_now()
        return JobState.RESIZING

    def _stop_for_node_failure(self) -> JobState:
        """Another machine failed with no restarts left: the job is over here too."""
        self._set_state(JobState.STOPPING)
        self._stop_now()
        return JobState.FAILED

    def _stop_now(self) -> None:
        wk.stop(self.group, wk.TEARDOWN_ESCALATION)
        wk.join_threads(self.group, timeout=2.0)
        for worker in self.group:
            worker.state = WorkerState.STOPPED

    def _release_group(self) -> None:
        """Every rank has its result: let the workers exit, then collect their output."""
        for worker in self.group:
            worker.send(("exit", None))
        if not wk.wait_for_exit(self.group, _EXIT_AFTER_RESULTS_TIMEOUT):
            wk.stop(self.group, wk.TEARDOWN_ESCALATION)
        for worker in self.group:
            worker.close_control()
        wk.join_threads(self.group)

    # -- the result ----------------------------------------------------------------------

    def _result(self, state: JobState) -> JobResult:
        result = JobResult(
            run_id=self.run_id, state=state, world_size=self.world_size,
            restarts=self.restart_count, max_restarts=self.spec.max_restarts,
            duration=time.time() - self.started, log_dir=self.log_root,
            failure=self.failures[0] if state is JobState.FAILED and self.failures else None,
            failures=list(self.failures) if state is JobState.FAILED else [],
            tails={w.global_rank: list(w.tail) for w in self.group},
            stop_reason=self.stop_reason if state is JobState.STOPPED else None,
            resizes=self.resizes,
            commit=dict(self.snapshots.meta) if self.snapshots.meta else None,
            snapshot=self.snapshots.blob,
        )
        self.snapshots.close()
        if state is JobState.SUCCEEDED:
            ranks: dict[int, dict[str, Any]] = {}
            for worker in self.group:
                assert worker.result is not None
                ranks[worker.global_rank] = worker.result
            if self.round is not None:  # other machines' ranks
                for node in self.node_results.get(self.round.round_id, {}).values():
                    ranks.update(node["results"])
                    result.tails.update(node["tails"])
            for rank in sorted(ranks):
                result.values[rank] = _load(ranks[rank]["value"])
                for name, blob in ranks[rank]["pulled"].items():
                    result.pulled[name] = _load(blob)
                result.missing_pulls += ranks[rank]["missing"]
        return result


def _load(blob: bytes) -> Any:
    try:
        return cloudpickle.loads(blob)
    except Exception as exc:  # e.g. a class the kernel cannot import
        return Unpicklable("<value from worker>", f"{type(exc).__name__}: {exc}")


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
