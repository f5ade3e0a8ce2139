"""One sentence per event, for people: the dashboard's timeline and the text renderer's
``[elastic]`` lines both come from here, so they say the same thing."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..result import is_consequence
from ..wire.events import (
    AcceptingNodes,
    CheckpointMoved,
    CheckpointVanished,
    Committed,
    Event,
    Excluded,
    JobFinished,
    MachinesChanged,
    MembershipChanged,
    NetworkChosen,
    NodeConnected,
    RanksFinished,
    RanksRunning,
    RendezvousCompleted,
    ResizeRequested,
    Restarting,
    SessionBroken,
    SessionReformed,
    WorkerFailed,
    WorkersStarted,
)


@dataclass(frozen=True)
class Headline:
    """An event told to a person: one line of the dashboard's timeline or of the text output."""

    kind: str  # what happened, in a word: "rendezvous", "failure", "succeeded", ...
    text: str  # a sentence that reads on its own


def describe(event: Event) -> Headline | None:
    """What to tell a person about ``event``; None for events that are not news (output,
    state changes, ordinary commits)."""
    match event:
        case RendezvousCompleted(round=round_, world_size=world_size, nnodes=nnodes):
            return Headline("rendezvous", f"rendezvous round {round_}: world size {world_size} "
                                      f"on {count_of(nnodes, 'machine')}")
        case WorkersStarted(restart_count=restarts, ranks=ranks, stayed=stayed):
            after = f" after restart {restarts}" if restarts else ""
            new = tuple(r for r in ranks if r not in stayed)
            started = f"started ranks {_ranks(new)}{after}" if new \
                else f"no rank started{after}"
            kept = f"; ranks {_ranks(stayed)} stayed in their processes" if stayed else ""
            return Headline("start", started + kept)
        case RanksRunning(ranks=ranks, pids=pids):
            return Headline("running", f"ranks {_ranks(ranks)} run the cell "
                                       f"(pids {', '.join(str(p) for p in pids)})")
        case WorkerFailed(failure=failure) if is_consequence(failure):  # lost its peer
            return Headline("failure", f"rank {failure.rank} stopped: {failure.headline}")
        case WorkerFailed(failure=failure):
            return Headline("failure", f"rank {failure.rank} failed: {failure.headline}")
        case RanksFinished(ranks=ranks, running=running):
            return Headline("finished", f"{_rank_list(ranks)} finished; {_rank_list(running)} "
                                    "still running")
        case Restarting(restart_count=count, max_restarts=most, root_cause=cause,
                        no_state=no_state):
            why = ("; the cell keeps no elastic_magic.State (nor a trainer's integration): "
                   "every rank runs it again from its start") if no_state else ""
            return Headline("restart", f"restarting the group ({count}/{most}) after rank "
                                   f"{cause.rank}: {cause.headline}{why}")
        case CheckpointVanished(path=path, counter=counter, written=written):
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(written))
            return Headline("checkpoint", f"--checkpoint-dir {path} holds no checkpoint, but "
                            f"its checkpoint {counter} was written there on {when}: starting "
                            "from scratch. If you removed or moved it, nothing is wrong; if "
                            "not, someone who can write a folder on the way may have put an "
                            "empty folder in its place: stop the job and find yours")
        case CheckpointMoved(path=path, overlooked=None):
            return Headline("checkpoint", f"--checkpoint-moved was not needed: the checkpoint "
                            f"in {path} is the latest its folder held there. Take the flag "
                            "off the cell, so that a folder put in its place is refused")
        case CheckpointMoved(path=path, overlooked=overlooked):
            return Headline("checkpoint", f"--checkpoint-moved: resuming from {path} although "
                            f"{overlooked}; it is now the folder's latest. Take the flag off "
                            "the cell, so that a folder put in its place later is refused")
        case Committed(origin="checkpoint", step=step):
            return Headline("checkpoint", f"resuming from the checkpoint of step {step}")
        case ResizeRequested(target=target, graceful=graceful):
            when = "at the next commit" if graceful else "now"
            return Headline("resize", f"resize to {count_of(target, 'worker')} requested ({when})")
        case MembershipChanged(old_nproc=old, new_nproc=new):
            return Headline("membership", f"resizing: {old} -> {count_of(new, 'worker')} "
                                      "(not a restart)")
        case AcceptingNodes(command=command):
            return Headline("nodes", f"other machines join this job with: {command}")
        case NodeConnected(peer=peer, nproc=nproc, connected=connected, reason=reason):
            verb = f"joined with {count_of(nproc, 'worker')}" if connected else "left"
            return Headline("nodes", f"machine {peer} {verb}" + (f": {reason}" if reason else ""))
        case MachinesChanged(allocations=lines):  # the launcher's status line
            return Headline("nodes", "launcher: " + ("; ".join(lines) or "no allocation left"))
        case Excluded(what=what, why=why, goes_on=goes_on):
            then = "the others go on from the last commit (not a restart)" if goes_on \
                else "too few are left to go on"
            return Headline("excluded", f"{what} excluded: {why}; {then}")
        case SessionBroken(reason=reason, reforms=True, restart_count=count, max_restarts=most):
            return Headline("restart", f"{reason}: the session re-forms before the next cell "
                                   f"(restart {count}/{most})")
        case SessionBroken(reason=reason, max_restarts=most):
            return Headline("failed", f"{reason}: the session has ended ({most} restarts spent; "
                                  "--max-restarts allows more)")
        case SessionReformed(setup_cells=cells, step=step, world_size=size):
            state = "" if step is None else f", State at step {step}"
            return Headline("reformed", f"session re-formed: {count_of(cells, 'setup cell')} "
                                    f"replayed{state}; world size {size}")
        case NetworkChosen():
            return Headline("network", network_text(event))
        case JobFinished(result=result):
            reason = f" ({result.stop_reason})" if result.stop_reason else ""
            return Headline(result.state.value,
                        f"{result.summary()}{reason}; logs: {result.log_dir}")
        case _:
            return None


def network_text(chosen: NetworkChosen) -> str:
    """Which interface a machine's workers use, and why it matters when its hostname
    resolves to loopback."""
    machine = f"machine {chosen.machine}"
    if chosen.machine_is_loopback:  # every machine on this host: no hostname to warn about
        text = f"{machine}: loopback, so only machines on this host can take part"
        if chosen.variables:
            text += f"; its workers stay on {chosen.interface}"
        if chosen.kept:
            text += "; kept your " + ", ".join(f"{name}={value}" for name, value in chosen.kept)
        return text
    if chosen.variables:
        names = " and ".join(name for name, _ in chosen.variables)
        text = f"{machine}: its workers reach the others through {chosen.interface} ({names})"
    elif chosen.kept:
        text = f"{machine}: its workers use the network you chose"
    else:  # no interface of this machine carries that address
        text = (f"{machine}: no interface of this machine carries that address; set "
                "GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) with --env, or on each machine")
    if chosen.kept:
        text += "; kept your " + ", ".join(f"{name}={value}" for name, value in chosen.kept)
    address = chosen.hostname_address
    if address is None or chosen.hostname_is_loopback:
        resolves = f"resolves to {address} (loopback)" if address else "does not resolve"
        text += (f". Its hostname {chosen.hostname} {resolves}: gloo and NCCL would otherwise "
                 "offer the other machines an address they cannot reach")
    return text


def clock(when: float) -> str:
    """The one way a time of day is shown (the dashboard's script does the same)."""
    return time.strftime("%H:%M:%S", time.localtime(when))


def duration(seconds: float) -> str:
    """The one way a length of time is shown: 4.2s, 2m 05s, 1h 02m (as the dashboard's
    script and the JupyterLab extension do)."""
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.1f}s"
    whole = int(s)
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    return f"{whole // 3600}h {whole % 3600 // 60:02d}m"


def count_of(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _rank_list(ranks: tuple[int, ...]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _ranks(ranks: tuple[int, ...]) -> str:
    """Ranks on one machine are contiguous: 0-7 rather than eight numbers."""
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 else ", ".join(map(str, ranks))
