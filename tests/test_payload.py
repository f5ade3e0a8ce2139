import os
import threading

import cloudpickle
import pytest

from elastic_magic.wire.payload import (
    PayloadError,
    capture_globals,
    cell_payload,
    referenced_names,
    uses_ipython_syntax,
)
from elastic_magic.wire.protocol import Channel, ProtocolError, new_secret

pytestmark = pytest.mark.unit


def test_referenced_names_cover_functions_and_skip_stores():
    names = referenced_names("x = a + 1\ndef f():\n    return b\nclass C:\n    y = c\n")
    assert {"a", "b", "c"} <= names
    assert "x" not in names


def test_globals_travel_by_value_and_modules_by_name():
    def notebook_fn(v):
        return v * 2

    notebook_fn.__module__ = "__main__"  # as if defined in a notebook cell
    namespace = {"os": os, "notebook_fn": notebook_fn, "data": [1, 2], "unused": object()}
    values, modules = capture_globals({"os", "notebook_fn", "data", "missing"}, namespace)
    assert modules == {"os": "os"}
    assert set(values) == {"notebook_fn", "data"}
    assert cloudpickle.loads(values["notebook_fn"])(4) == 8


def test_unpicklable_global_is_named_with_reason():
    with pytest.raises(PayloadError) as err:
        cell_payload("print(lock, ok)", {"lock": threading.Lock(), "ok": 1})
    message = str(err.value)
    assert "lock (lock)" in message and "cannot pickle" in message
    assert "nothing was started" in message


def test_syntax_error_and_empty_cell():
    with pytest.raises(PayloadError, match="cell line 2"):
        cell_payload("x = 1\nif x\n", {})
    with pytest.raises(PayloadError, match="empty"):
        cell_payload("  \n", {})


def test_ipython_syntax_detected():
    assert uses_ipython_syntax("get_ipython().run_line_magic('time', 'x')")
    assert not uses_ipython_syntax("print(1)")


def test_channel_round_trip_and_tamper():
    key = new_secret()
    r, w = os.pipe()
    Channel(w, key).send(("run", {"x": 1}))
    assert Channel(r, key).recv() == ("run", {"x": 1})
    Channel(w, new_secret()).send(("run", "forged"))
    with pytest.raises(ProtocolError, match="signature"):
        Channel(r, key).recv()
    os.close(w)
    with pytest.raises(EOFError):
        Channel(r, key).recv()
    os.close(r)
