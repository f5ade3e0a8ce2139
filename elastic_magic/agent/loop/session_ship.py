"""Survivors stay in a session: the ranks that join get the user's definitions.

Once the new ranks have replayed the setup cells, the survivor of lowest rank (of those
that lack the fewest names) sends them what they still lack of its namespace: three small
payloads, on the new ranks, the survivor, the new ranks (``worker/namespace_ship.py``), run
only when a rank joins. The survivor's values cross as bytes from its report pipe to the new
ranks' control pipes, both signed with the job's key; this agent loads only the envelope
(names and bytes, a ``ShippedNamespace``) from the signed report, as it loads every cell's
result, never the values. What a new rank could not get is remembered, by its process,
and checked before a cell that reads it (``check``): that cell fails, naming the names, on
no rank's time, and the group stays.

Across machines the survivors are the head's (a machine that joined starts its ranks again
each round): the payloads reach the other machines' new ranks in the head's ``SessionCell``
(signed link frames), and their answers come back in their ``CellReport``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Collection
from typing import Any

from ...wire.payload import Payload, step_payload
from ...wire.shipped import ShippedNamespace
from ...worker import namespace_ship
from ..policy import CellStep
from .cell_runner import CellOutcome
from .cells import OtherMachines
from .engine import Engine

Run = Callable[[Payload, Collection[int]], CellOutcome]
Process = int | tuple[str, int]  # a pid here; (round id, rank) on another machine


class NamespaceShipping:
    """What each rank that joined the session lacks of the survivors' namespace."""

    def __init__(self, engine: Engine, others: OtherMachines) -> None:
        self.engine = engine
        self.others = others  # the other machines' answers
        self.lacking: dict[Process, dict[str, str]] = {}  # a rank's process -> name -> why

    def _payload(self, fn: Callable[..., Any], *args: Any) -> Payload:
        return step_payload(self.engine.payload, fn, *args)

    def _value(self, rank: int) -> Any:
        """The value rank ``rank`` answered the payload with (from its signed report, or
        its machine's signed CellReport)."""
        group = self.engine.group
        assert group is not None
        worker = next((w for w in group.workers if w.global_rank == rank), None)
        result = self.others.results()[rank] if worker is None else worker.result
        if worker is not None:
            worker.result = None  # not the next cell's value
        assert result is not None
        return pickle.loads(result.value)

    def _processes(self) -> dict[int, Process]:
        """Each rank's process as this machine can name it: its pid here; on another
        machine, its rank in this round (the ranks there start again every round)."""
        group, info = self.engine.group, self.engine.round
        assert group is not None and info is not None
        here: dict[int, Process] = {w.global_rank: w.pid for w in group.workers}
        return {r: here.get(r, (info.round_id, r)) for r in range(info.world_size)}

    def ship(self, run: Run, stayed: Collection[int], new: Collection[int]) -> CellOutcome:
        """The survivors' namespace to the ``new`` ranks, after their setup cells: the
        first outcome that is not a success, or the last."""
        pids = self._processes()
        self.lacking = {pid: names for pid, names in self.lacking.items()
                        if pid in pids.values()}
        done = CellOutcome(CellStep.DONE, [])
        if not new or not stayed:
            return done
        source = min(stayed, key=lambda r: (len(self.lacking.get(pids[r], {})), r))
        to = tuple(sorted(new))
        outcome = run(self._payload(namespace_ship.present), to)
        if outcome.step is not CellStep.DONE or outcome.failures:
            return outcome
        # what every new rank holds, under the same definition on each
        answers: list[dict[str, str | None]] = [self._value(r) for r in to]
        have = {n: d for n, d in answers[0].items() if all(a.get(n, ...) == d
                                                            for a in answers[1:])}
        outcome = run(self._payload(namespace_ship.export, have, to), (source,))
        if outcome.step is not CellStep.DONE or outcome.failures:
            return outcome
        shipped: ShippedNamespace = self._value(source)
        outcome = run(self._payload(namespace_ship.absorb, shipped), to)
        if outcome.step is not CellStep.DONE or outcome.failures:
            return outcome
        inherited = self.lacking.get(pids[source], {})
        for rank in to:
            lacks = {**inherited, **self._value(rank)}
            if lacks:
                self.lacking[pids[rank]] = lacks
        return done

    def forget(self) -> None:
        """Every rank started again: none lacks anything."""
        self.lacking = {}

    def check(self, run: Run, payload: Payload) -> CellOutcome | None:
        """Before a cell: None when it may run on every rank; else the outcome of the
        check on the ranks that lack names it reads (failed: naming them)."""
        if not self.lacking or payload.source is None:
            return None
        pids = self._processes()
        ranks = tuple(sorted(r for r, pid in pids.items() if pid in self.lacking))
        if not ranks:
            self.lacking = {}
            return None
        names = {n: why for lacks in self.lacking.values() for n, why in lacks.items()}
        given = (*payload.globals, *payload.modules)
        outcome = run(self._payload(namespace_ship.check, payload.source, names, given), ranks)
        if outcome.step is not CellStep.DONE or outcome.failures:
            for worker in self.engine.group.workers if self.engine.group else []:
                if worker.global_rank not in ranks:
                    worker.result = None  # the cell ran on no rank: no values
            return outcome
        for rank in ranks:  # what they still lack
            still = set(self._value(rank))
            lacks = {n: why for n, why in self.lacking[pids[rank]].items() if n in still}
            if lacks:
                self.lacking[pids[rank]] = lacks
            else:
                del self.lacking[pids[rank]]
        return None
