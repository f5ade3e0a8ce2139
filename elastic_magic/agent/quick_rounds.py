"""Rounds without idle waits: what torch's rendezvous handler sleeps that a job here does
not need. Imported by ``rendezvous.py``, before any handler runs.

torch sleeps a random 0-0.3 s before a run id's first round (``_delay`` with a range), to
spread the first requests of many nodes. Every job here is a new run id on a few machines,
so that sleep was about 150 ms of every launch (a third of a warm one). Its other waits,
fixed seconds between polls of the state, are kept.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

_torch_delay = dynamic_rendezvous._delay


def _delay_without_first_round_jitter(seconds: float | tuple[float, float]) -> None:
    if not isinstance(seconds, tuple):
        _torch_delay(seconds)


dynamic_rendezvous._delay = _delay_without_first_round_jitter
