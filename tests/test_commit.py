"""Commits: the snapshot format round-trips what a State holds, and a commit is atomic: a
rank that dies in the middle of one leaves the previous commit whole, in the agent and in
the checkpoint folder."""

from __future__ import annotations

import io
import textwrap

import pytest
import torch

import elastic_magic as em
from elastic_magic import snapshot_format


def test_the_format_round_trips_tensors_of_every_kind_and_reads_torch_save():
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    shared = torch.arange(6.0)
    data = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "odd": [torch.tensor(True), torch.zeros(0, 3), torch.arange(6).reshape(2, 3).t(),
                    torch.randn(3, dtype=torch.complex64), torch.ones(2, dtype=torch.bfloat16),
                    torch.randn(4).to_sparse(), shared, shared],
            "plain": {"step": 7, "name": "run"}}
    for writer in (snapshot_format.save, torch.save):
        buffer = io.BytesIO()
        writer(data, buffer)
        buffer.seek(0)
        back = snapshot_format.load(buffer)
        torch.testing.assert_close(back["model"], data["model"], rtol=0, atol=0)
        torch.testing.assert_close(back["optimizer"]["state"], data["optimizer"]["state"],
                                   rtol=0, atol=0)
        for ours, theirs in zip(back["odd"], data["odd"], strict=True):
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
            assert torch.equal(ours.to_dense(), theirs.to_dense())
        assert back["plain"] == data["plain"]
    whole = io.BytesIO()
    snapshot_format.save(data, whole)
    with pytest.raises(EOFError, match="ends inside a tensor"):
        snapshot_format.load(io.BytesIO(whole.getvalue()[:-10]))


CRASH = textwrap.dedent("""
    import os, signal, torch, elastic_magic

    class DiesWhenPickled:  # the rank dies in the middle of writing its snapshot
        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGKILL)

    model = torch.nn.Linear(64, 64)
    state = elastic_magic.State(model=model, step=0, doomed=None)
    for step in (1, 2):
        state.step = step
        with torch.no_grad():
            model.weight.fill_(step)
        if step == 2:
            state.doomed = DiesWhenPickled()
        state.commit()
""")


def test_a_rank_that_dies_mid_commit_leaves_the_previous_commit_whole(tmp_path, log_dir):
    ckpt = tmp_path / "ckpt"
    with pytest.raises(em.JobFailedError) as failed:
        em.launch(CRASH, nproc=1, checkpoint_dir=ckpt, log_dir=log_dir,
                  render=lambda e: None)
    result = failed.value.result
    assert result.failure.signal == "SIGKILL" and result.commit["step"] == 1
    for blob in (result.snapshot, (ckpt / "snapshot.pt").read_bytes()):
        snapshot = snapshot_format.load(io.BytesIO(blob))
        assert snapshot["values"]["step"] == 1
        assert torch.all(snapshot["objects"]["model"]["weight"] == 1)
    assert not list(ckpt.glob(".snapshot*"))  # no half-written temporary left
