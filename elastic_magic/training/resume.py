"""Going on in place after a failure or a resize (survivors stay, Horovod's
``hvd.elastic.run``):

    model = Net(); optimizer = torch.optim.AdamW(model.parameters())
    state = elastic_magic.State(model=model, optimizer=optimizer, loader=loader, step=0)

    @elastic_magic.run
    def train(state):
        ddp = DDP(model)          # tied to the process group: made in the function
        for x, y in loader: ...   # the loader (elastic) splits batches at each epoch's start
    train(state)

With ``--survivors``, a rank whose peer failed, or that leaves at a commit for a resize,
stays in ``train``'s caller: it waits there for the next group, rolls ``state`` back to
the last commit and calls ``train(state)`` again; what the cell made before the call (the
model, the optimizer, imports, compiled code) is kept. New ranks run the cell from the
top. The rollback takes the commit from this rank's own memory when the objects holding
tensors have not changed since (``training/kept.py``), else from the agent's copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from ..worker import leave
from ..worker.in_place import rejoin
from .state import State, back_to_first_values, first_values_hold

P = ParamSpec("P")
R = TypeVar("R")


def run(function: Callable[P, R]) -> Callable[P, R]:
    """Call ``function(state, ...)``; with ``--survivors``, go on in place after a peer's
    failure or a resize (see the module's text). Without a job, or without the flag, it
    is a plain call.

    Going on in place, a rank waits for the next group, rolls ``state`` back to its last
    commit, runs the ``State.on_reset`` callbacks and calls ``function`` again. An error
    in the rollback or a callback is taken as one in ``function``: the rank reports it and
    goes on in place in the next group (each such group counts as a restart), or it is
    raised.

    Args:
        function: The training function; its first argument is the elastic State.

    Returns:
        A wrapper with ``function``'s signature, returning what ``function`` returns.
        Called with anything but a State first, it raises TypeError; whatever
        ``function`` raises that it does not go on after is raised again.

    Example:
        >>> @elastic_magic.run
        ... def train(state): ...
        >>> train(state)
    """

    @functools.wraps(function)
    def in_place(*args: P.args, **kwargs: P.kwargs) -> R:
        state = args[0] if args else None
        if not isinstance(state, State):
            raise TypeError(f"@elastic_magic.run: call {function.__name__}(state, ...) with "
                            f"the elastic_magic.State first, not {type(state).__name__}")
        rejoined = False
        while True:
            try:
                if rejoined:  # in the next group; the agent's word may end it here too
                    leave.resume()
                    if not state.restore():  # the last commit, from our memory if whole
                        back_to_first_values(state)  # none yet: where the new ranks start
                    for callback in state._on_reset:
                        callback()
                return function(*args, **kwargs)
            except BaseException as exc:
                try:  # here, not in a function: the word could land at its entry
                    went_on = rejoin(exc, in_place=_can_go_back(state))
                except KeyboardInterrupt as word:
                    went_on = _rejoin_after_word(word, exc, state)
                if not went_on:
                    raise
                rejoined = True

    return in_place


def _rejoin_after_word(word: KeyboardInterrupt, exc: BaseException, state: State) -> bool:
    """:func:`rejoin` after ``exc``, when a KeyboardInterrupt (``word``) came as it began.
    A peer's death reaches a collective and the agent at once, so the agent's word for it
    can land while the rank sets out to leave: it asks for what the rank is doing already.
    Until :func:`leave.pause`, ``rejoin`` only reads, so it starts over. After it, the word
    is no longer signalled: a KeyboardInterrupt then is a stop or the user's, and is raised,
    as is the word when ``exc`` is not an error to stay for."""
    while leave.word_while_running():
        try:
            if rejoin(exc, in_place=_can_go_back(state)):
                return True
            break
        except KeyboardInterrupt as again:  # another word (a later round's), still unpaused
            word = again
    raise word


def _can_go_back(state: State) -> bool:
    """Whether a survivor can go back, in place, to where the new ranks start: the last
    commit (every rank takes part in each, so this process knows whether there is one), or
    with none yet, the first values, if its large objects are as they were then. Else it
    runs the cell again from the top. A sharded State always does (its shards move)."""
    if state._sharded:
        return False
    return state._kept is not None or state.restored_step is not None \
        or first_values_hold(state)
