"""torch's private names: all of them reached from ``elastic_magic/torch_internals.py`` only,
each checked against the installed torch, and a torch that lacks one refused by name."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from elastic_magic import torch_internals as ti


def test_every_private_name_elastic_magic_relies_on_is_there_in_the_installed_torch():
    ti.check_all()
    for need in ti.NEEDS:  # the objects the adapters use, found where the needs say
        assert ti.check(need) is not None, need.where


def test_the_checks_see_torchs_own_functions_through_the_poll_hooks_installed():
    from elastic_magic.agent import quick_rounds

    assert dynamic_rendezvous._delay is quick_rounds._delay
    assert ti.check(ti.DELAY) is quick_rounds._delay  # the signature seen is torch's
    assert ti.check(ti.OPERATION_RUN) is quick_rounds._run
    assert ti.pace_rendezvous_polls(quick_rounds._delay, quick_rounds._run) == (
        quick_rounds._torch_delay, quick_rounds._torch_run)
    with pytest.raises(RuntimeError, match="already paced"):
        ti.pace_rendezvous_polls(lambda seconds: None, quick_rounds._run)


def _refusal(need: ti.Need) -> str:
    with pytest.raises(ti.UnsupportedTorch) as refused:
        ti.check(need)
    message = str(refused.value)
    assert f"torch {torch.__version__} is not supported by elastic_magic" in message
    assert need.where in message
    assert f"pip install 'torch{ti.SUPPORTED_TORCH}'" in message
    return message


def test_a_torch_without_a_name_is_refused_naming_the_version_the_name_and_the_fix(
        monkeypatch):
    monkeypatch.delattr(dynamic_rendezvous, "_remove_participant_epilogue")
    assert "does not exist in this torch" in _refusal(ti.REMOVE_EPILOGUE)
    monkeypatch.delattr(dynamic_rendezvous.DynamicRendezvousHandler,
                        "_create_tcp_store_server")
    assert "does not exist" in _refusal(ti.CREATE_STORE)
    assert "no longer uses _create_tcp_store_server" not in _refusal(ti.CREATE_STORE)


def test_a_changed_signature_or_a_method_that_stopped_using_a_name_is_refused(monkeypatch):
    monkeypatch.setattr(dynamic_rendezvous, "_remove_participant_epilogue",
                        lambda state, settings, extra: None)
    assert "takes (state, settings, extra) here, where elastic_magic expects " \
           "(state, settings)" in _refusal(ti.REMOVE_EPILOGUE)

    def next_rendezvous(self):  # a torch that no longer hosts the store through the hook
        return self._bootstrap_store_info, self._shared_tcp_store_server

    monkeypatch.setattr(dynamic_rendezvous.DynamicRendezvousHandler, "next_rendezvous",
                        next_rendezvous)
    assert "no longer uses _create_tcp_store_server" in _refusal(ti.NEXT_ROUND)
    monkeypatch.delattr(dynamic_rendezvous._NodeDesc, "__annotations__")
    assert "no longer uses addr, pid" in _refusal(ti.NODE)


def test_an_adapter_checks_its_names_before_it_reaches_in(monkeypatch):
    monkeypatch.setattr(ti, "_checked", {})
    monkeypatch.delattr(dynamic_rendezvous, "_remove_participant_epilogue")
    handler = SimpleNamespace()  # never reached: the check refuses first
    with pytest.raises(ti.UnsupportedTorch, match="_remove_participant_epilogue"):
        ti.remove_rendezvous_node(handler, "10.0.0.1", 1)  # type: ignore[arg-type]
    monkeypatch.delattr(sys.modules["torch.library"], "_del_library")
    with pytest.raises(ti.UnsupportedTorch, match=re.escape("torch.library._del_library")):
        ti.is_library_cleanup(print)
