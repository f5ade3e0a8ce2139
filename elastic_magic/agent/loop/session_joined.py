"""A session's loop on a machine that joined (``elastic-magic join``): it forms its group when
the head's round does, runs the cells the head sends and reports each; a machine that joins
or leaves re-forms the session at the next cell boundary (the head broadcasts Regroup,
every machine joins the new round). The head counts restarts."""

from __future__ import annotations

import dataclasses

from ...result import JobResult, JobState, RankFailure
from ...wire.link_messages import CellReport, InterruptCell, SessionCell
from ...wire.messages import Action
from ...wire.payload import Payload
from ..inbox import FromLink, InboxItem
from ..policy import CellStep
from .cell_runner import CellRunner
from .engine import Engine


class JoinedSessionLoop:
    """This machine's part of the head's session, until the head ends it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.runner = CellRunner(engine)
        self.formed = False  # the group is up and whole
        self.ended: JobState | None = None
        engine.switchboard.loop_items = self._own

    def run(self) -> JobResult:
        engine = self.engine
        final = JobState.STOPPED
        try:
            engine.open()
            self._form()
            while self.ended is None:
                item = self.runner.wait_idle()
                if isinstance(item, FromLink) and isinstance(item.message, SessionCell):
                    self._run_sent_cell(item.message)
                    continue
                action = None if item is None else engine.switchboard.handle(item)
                if action is Action.STOP:
                    self.ended = JobState.STOPPED
                elif action is Action.REGROUP:
                    self._form()
                elif engine.group is not None and self.formed and self.runner.died():
                    outcome = self.runner.break_idle()
                    self._break(outcome.failures)
                    self._report(-1, CellStep.BROKEN, outcome.failures)
            final = self.ended or JobState.STOPPED
        except BaseException:
            final = JobState.FAILED
            raise
        finally:
            self.runner.dismiss()
            result = engine.finish(final)
        return result

    def _own(self, item: InboxItem) -> InboxItem | None:
        if isinstance(item, FromLink) and isinstance(item.message, InterruptCell):
            info = self.engine.round
            self.runner.interrupt = info is not None and item.message.round_id == info.round_id
            return None
        return self.runner.own(item)

    def _form(self) -> None:
        """Join the head's next round; start the group; report it up (seq 0)."""
        engine = self.engine
        engine.close_group()
        info = engine.next_round()
        if info is None:
            self.ended = JobState.STOPPED
            return
        engine.start_group(info)
        self.formed = True
        self._run_and_report(0, None)

    def _run_sent_cell(self, cell: SessionCell) -> None:
        engine = self.engine
        if engine.round is None or cell.round_id != engine.round.round_id:
            return  # for a round this machine is not in
        if not self.formed or engine.group is None:
            self._report(cell.seq, CellStep.BROKEN, engine.failures)
            return
        here = dataclasses.replace(cell.payload, cwd=engine.payload.cwd,
                                   sys_path=engine.payload.sys_path)  # this machine's
        self._run_and_report(cell.seq, here, cell.ranks)

    def _run_and_report(self, seq: int, payload: Payload | None,
                        ranks: tuple[int, ...] | None = None) -> None:
        outcome = self.runner.run(payload, ranks)
        if outcome.step is CellStep.BROKEN:
            self._break(outcome.failures)
        self._report(seq, outcome.step, outcome.failures, ranks)

    def _report(self, seq: int, step: CellStep, failures: list[RankFailure],
                ranks: tuple[int, ...] | None = None) -> None:
        engine, info = self.engine, self.engine.round
        assert info is not None
        results = engine.group.results() if engine.group and step is CellStep.DONE else {}
        results = {r: v for r, v in results.items() if ranks is None or r in ranks}
        engine.role.send_to_head(CellReport(info.round_id, seq, info.node_rank, results,
                                            failures, broken=step is CellStep.BROKEN))

    def _break(self, failures: list[RankFailure]) -> None:
        self.engine.failures, self.formed = failures, False  # the head counts restarts
