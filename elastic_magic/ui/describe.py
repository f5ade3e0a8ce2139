"""One sentence per event, for people: the dashboard's timeline and the text renderer's
``[elastic]`` lines both come from here, so they say the same thing."""

from __future__ import annotations

from dataclasses import dataclass

from ..events import (
    AcceptingNodes,
    Committed,
    Event,
    JobFinished,
    MembershipChanged,
    NodeConnected,
    RanksFinished,
    RendezvousCompleted,
    ResizeRequested,
    Restarting,
    SessionBroken,
    SessionReformed,
    WorkerFailed,
    WorkersStarted,
)


@dataclass(frozen=True)
class Note:
    kind: str  # what happened, in a word: "rendezvous", "failure", "succeeded", ...
    text: str  # a sentence that reads on its own


def describe(event: Event) -> Note | None:
    """What to tell a person about ``event``; None for events that are not news (output,
    state changes, ordinary commits)."""
    match event:
        case RendezvousCompleted(round=round_, world_size=world_size, nnodes=nnodes):
            return Note("rendezvous", f"rendezvous round {round_}: world size {world_size} "
                                      f"on {count_of(nnodes, 'node')}")
        case WorkersStarted(attempt=attempt, ranks=ranks, pids=pids):
            return Note("start", f"attempt {attempt}: started ranks {_ranks(ranks)} "
                                 f"(pids {', '.join(map(str, pids))})")
        case WorkerFailed(failure=failure) if failure.consequence:
            return Note("failure", f"rank {failure.rank} stopped: {failure.headline}")
        case WorkerFailed(failure=failure):
            return Note("failure", f"rank {failure.rank} failed: {failure.headline}")
        case RanksFinished(ranks=ranks, running=running):
            return Note("finished", f"{_rank_list(ranks)} finished; {_rank_list(running)} "
                                    "still running")
        case Restarting(restart_count=count, max_restarts=most, root_cause=cause):
            return Note("restart", f"restarting the group ({count}/{most}) after rank "
                                   f"{cause.rank}: {cause.headline}")
        case Committed(origin="checkpoint", step=step):
            return Note("checkpoint", f"resuming from the checkpoint of step {step}")
        case ResizeRequested(target=target, graceful=graceful):
            when = "at the next commit" if graceful else "now"
            return Note("resize", f"resize to {count_of(target, 'worker')} requested ({when})")
        case MembershipChanged(old_nproc=old, new_nproc=new):
            return Note("membership", f"resizing: {old} -> {count_of(new, 'worker')} "
                                      "(not a restart)")
        case AcceptingNodes(command=command):
            return Note("nodes", f"other machines join this job with: {command}")
        case NodeConnected(peer=peer, nproc=nproc, connected=connected, reason=reason):
            verb = f"joined with {count_of(nproc, 'worker')}" if connected else "left"
            return Note("nodes", f"machine {peer} {verb}" + (f": {reason}" if reason else ""))
        case SessionBroken(reason=reason, reforms=True, restart_count=count, max_restarts=most):
            return Note("restart", f"{reason}: the session re-forms before the next cell "
                                   f"(restart {count}/{most})")
        case SessionBroken(reason=reason, max_restarts=most):
            return Note("failed", f"{reason}: the session has ended ({most} restarts spent; "
                                  "--max-restarts allows more)")
        case SessionReformed(setup_cells=cells, step=step, world_size=size):
            state = "" if step is None else f", State at step {step}"
            return Note("reformed", f"session re-formed: {count_of(cells, 'setup cell')} "
                                    f"replayed{state}; world size {size}")
        case JobFinished(result=result):
            reason = f" ({result.stop_reason})" if result.stop_reason else ""
            return Note(result.state.value,
                        f"{result.summary()}{reason}; logs: {result.log_dir}")
        case _:
            return None


def count_of(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _rank_list(ranks: tuple[int, ...]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _ranks(ranks: tuple[int, ...]) -> str:
    """Ranks on one machine are contiguous: 0-7 rather than eight numbers."""
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 else ", ".join(map(str, ranks))
