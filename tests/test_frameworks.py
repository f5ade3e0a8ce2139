"""Code that initialises the process group itself runs unchanged with the default flags:
a torchrun script (compared with real torchrun), PyTorch Lightning and accelerate, each with
its own settings in effect; cells that rely on the automatic group keep working."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import elastic_magic as em

# How the default group's timeout in effect is read back (gloo keeps it in its options).
PG_TIMEOUT = textwrap.dedent("""
    def pg_timeout():
        pg = torch.distributed.distributed_c10d._get_default_group()
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
""")

# A torchrun script as users write them: its own init_process_group, its own checkpoint,
# resumed at start. Rank 1 dies once, in the first attempt, at step KILL_AT.
SCRIPT = textwrap.dedent("""
    import os, signal
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    STEPS, KILL_AT, BATCH = 12, 5, 16
""") + PG_TIMEOUT + textwrap.dedent("""

    def main():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        dist.init_process_group("gloo", timeout=timedelta(seconds=123))
        print(f"GROUP rank {rank} local {local_rank} world {dist.get_world_size()} "
              f"backend {dist.get_backend()} timeout {pg_timeout()}", flush=True)
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                        torch.nn.Linear(16, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ckpt = os.path.join(os.environ["CKPT_DIR"], "ckpt.pt")
        start = 0
        if os.path.exists(ckpt):
            saved = torch.load(ckpt)
            model.module.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            start = saved["step"]
            print(f"RESUMED rank {rank} attempt {attempt} at step {start}", flush=True)
        data = torch.randn(STEPS * BATCH, 8, generator=torch.Generator().manual_seed(1))
        target = torch.sin(data.sum(1, keepdim=True))
        share = BATCH // world
        for step in range(start, STEPS):
            if step == KILL_AT and rank == 1 and attempt == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            rows = slice(step * BATCH + rank * share, step * BATCH + (rank + 1) * share)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(data[rows]), target[rows]).backward()
            opt.step()
            if rank == 0:  # every step, atomically; the barrier: no rank runs ahead of it
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "step": step + 1}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
            dist.barrier()
        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(os.environ["CKPT_DIR"], "final.pt"))
        dist.destroy_process_group()


    if __name__ == "__main__":
        main()
""")


def _reports(text: str) -> list[str]:
    """The script's GROUP and RESUMED lines, sorted. torchrun's ranks share one stdout,
    where one rank's line may land inside another's."""
    pattern = r"GROUP rank \d+ local \d+ world \d+ backend \w+ timeout [\d.]+\d|RESUMED.*?step \d+"
    return sorted(re.findall(pattern, text))


def test_torchrun_script_runs_unchanged_and_resumes_as_under_torchrun(tmp_path, log_dir,
                                                                      recorder):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    theirs, ours = tmp_path / "torchrun", tmp_path / "elastic"
    theirs.mkdir()
    ours.mkdir()
    # The store-sharing opt-out makes stock torchrun restarts reliable (see REFERENCES).
    env = {**os.environ, "CKPT_DIR": str(theirs), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", "--monitor-interval", "0.1", str(script)],
        env=env, capture_output=True, text=True, timeout=180)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]

    result = em.launch(SCRIPT, nproc=2, max_restarts=1, env=[f"CKPT_DIR={ours}"],
                       log_dir=log_dir, render=recorder)
    assert result.ok and result.restarts == 1
    lines = "\n".join(recorder.lines(0) + recorder.lines(1))

    # Two attempts, every rank with the script's own timeout (not the job's 300 s); the
    # second resumed from the script's checkpoint of step 5, the one before the kill.
    expected = sorted(
        [f"GROUP rank {r} local {r} world 2 backend gloo timeout 123.0" for r in (0, 1)] * 2
        + [f"RESUMED rank {r} attempt 1 at step 5" for r in (0, 1)])
    assert _reports(lines) == _reports(torchrun.stdout) == expected

    mine, reference = torch.load(ours / "final.pt"), torch.load(theirs / "final.pt")
    assert mine.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(mine[name], reference[name], rtol=0, atol=1e-6)


def test_automatic_group_is_made_on_first_use_with_the_job_settings(log_dir):
    cell = PG_TIMEOUT + textwrap.dedent("""
        import torch, torch.distributed as dist
        before = dist.is_initialized()  # nothing used the group yet
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        (before, dist.is_initialized(), t.item(), dist.get_backend(), pg_timeout())
    """)
    result = em.launch(cell, nproc=2, timeout=77, log_dir=log_dir, render=lambda e: None)
    assert result.values == {r: (False, True, 3.0, "gloo", 77.0) for r in (0, 1)}


def test_state_as_the_first_use_of_the_group_restores_every_rank_alike(log_dir):
    """State(...) gathers the commit every rank restored: it makes the group if it must."""
    cell = textwrap.dedent("""
        import os, signal, torch, torch.distributed as dist, elastic_magic
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        state = elastic_magic.State(model=model, step=0)  # before any collective
        restored = state.restored_step
        while state.step < 4:
            if (state.step == 2 and dist.get_rank() == 1
                    and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
                os.kill(os.getpid(), signal.SIGKILL)
            with torch.no_grad():
                model.weight += 1
            state.step += 1
            state.commit()
        (restored, state.step, round(model.weight.sum().item(), 4), dist.get_world_size())
    """)
    result = em.launch(cell, nproc=2, max_restarts=1, log_dir=log_dir, render=lambda e: None)
    torch.manual_seed(0)
    expected_weight = round(torch.nn.Linear(2, 1).weight.sum().item() + 2 * 4, 4)
    assert result.restarts == 1
    assert result.values == {r: (2, 4, expected_weight, 2) for r in (0, 1)}


def test_init_after_the_automatic_group_was_made_says_what_to_do(log_dir):
    cell = ("import torch.distributed as dist\nrank = dist.get_rank()\n"
            "dist.init_process_group('gloo')\n")
    with pytest.raises(em.JobFailedError) as err:
        em.launch(cell, nproc=2, log_dir=log_dir, render=lambda e: None)
    root = err.value.result.failure
    assert root.exc_type == "ValueError" and root.cell_line == 3
    assert "twice" in root.message and "--no-init" in root.message


LIGHTNING = PG_TIMEOUT + textwrap.dedent("""
    from datetime import timedelta
    import torch, torch.distributed as dist
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g),
                                          torch.randn(32, 1, generator=g))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, num_nodes=1, max_steps=3,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=66)),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        logger=False, default_root_dir=ROOT)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    (type(trainer.strategy.cluster_environment).__name__, trainer.world_size,
     trainer.global_rank, trainer.global_step, dist.get_world_size(), dist.get_backend(),
     pg_timeout())
""")


def test_lightning_ddp_runs_with_its_own_backend_and_timeout(tmp_path, log_dir):
    result = em.launch(LIGHTNING, nproc=2, namespace={"ROOT": str(tmp_path)}, log_dir=log_dir,
                       render=lambda e: None)
    assert result.values == {
        r: ("TorchElasticEnvironment", 2, r, 3, 2, "gloo", 66.0) for r in (0, 1)}


ACCELERATE = PG_TIMEOUT + textwrap.dedent("""
    from datetime import timedelta
    import torch, torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    accelerator = Accelerator(
        cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=55))])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(accelerator.process_index))
    accelerator.backward(model(x).pow(2).mean())
    opt.step()
    weight = accelerator.unwrap_model(model).weight.detach().clone()
    gathered = [torch.zeros_like(weight) for _ in range(2)]
    dist.all_gather(gathered, weight)  # DDP kept the ranks in step
    (accelerator.num_processes, accelerator.process_index, str(accelerator.distributed_type),
     dist.get_backend(), pg_timeout(), torch.equal(*gathered))
""")


def test_accelerate_runs_with_its_own_timeout(log_dir):
    result = em.launch(ACCELERATE, nproc=2, log_dir=log_dir, render=lambda e: None)
    assert result.values == {
        r: (2, r, "DistributedType.MULTI_CPU", "gloo", 55.0, True) for r in (0, 1)}
