"""A Lightning and a HuggingFace ``Trainer`` cell recovering from a SIGKILL, with the one-line
integrations (``ElasticDDP``, ``ElasticCallback``) beside the same training under ``torchrun
--max-restarts 1`` resuming from the framework's own last checkpoint on disk (Lightning's
``ModelCheckpoint(every_n_train_steps=EVERY, save_last=True)`` and ``ckpt_path="last"``;
HF's ``save_steps=EVERY`` and ``resume_from_checkpoint=True``), both every EVERY steps.

In the first attempt rank 1 SIGKILLs itself right after optimizer step KILL_AT (after a
commit or checkpoint at step EVERY * (KILL_AT // EVERY)). Figures: from the kill to the
restart's next optimizer step done on every rank (``lightning_recovery``, ``hf_recovery``),
and the steps that had to be trained again (``*_steps_lost``: KILL_AT minus the step the
restart resumed from).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from . import cells
from .common import launch, scratch, stamps, warm_up

EVERY = 5
KILL_AT = 13

# Each optimizer step: stamps ``step<attempt>`` at the attempt's first step (every rank) and
# ``from<attempt>_<step before it>`` (rank 0); rank 1 stamps ``kill`` and dies at KILL_AT.
_STEP_HOOK = textwrap.dedent("""
    import os, signal
    ATTEMPT = os.environ["TORCHELASTIC_RESTART_COUNT"]
    _first = []

    def after_step(global_step):
        if not _first:
            _first.append(global_step)
            stamp(f"step{ATTEMPT}")
            if os.environ["RANK"] == "0":
                stamp(f"from{ATTEMPT}_{global_step - 1}")
        if ATTEMPT == "0" and global_step == KILL_AT and os.environ["RANK"] == "1":
            stamp("kill")
            os.kill(os.getpid(), signal.SIGKILL)
""")

LIGHTNING = _STEP_HOOK + cells.LIGHTNING_NET + textwrap.dedent("""
    class Steps(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            after_step(trainer.global_step)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 32), torch.randn(SAMPLES, 1))
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                         strategy=STRATEGY, max_steps=STEPS,
                         callbacks=[Steps(), *CHECKPOINTS], enable_progress_bar=False,
                         enable_model_summary=False, logger=False,
                         enable_checkpointing=bool(CHECKPOINTS), default_root_dir=OUT)
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=24, shuffle=True),
                ckpt_path=CKPT_PATH)
""")
LIGHTNING_OURS = textwrap.dedent("""
    from elastic_magic.integrations.lightning import ElasticDDP
    STRATEGY, CHECKPOINTS, CKPT_PATH = ElasticDDP(every=EVERY), [], None
""") + LIGHTNING
LIGHTNING_TORCHRUN = textwrap.dedent("""
    import os
    from pytorch_lightning.callbacks import ModelCheckpoint
    STRATEGY = "ddp"
    CHECKPOINTS = [ModelCheckpoint(dirpath=os.path.join(OUT, "ckpt"), save_last=True,
                                   every_n_train_steps=EVERY, save_top_k=-1)]
    CKPT_PATH = "last" if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0" else None
""") + LIGHTNING

HF = _STEP_HOOK + textwrap.dedent("""
    import os, torch
    from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                              TrainingArguments)

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            after_step(state.global_step)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                       n_head=2))
    ids = torch.randint(0, 64, (SAMPLES, 16))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=os.path.join(OUT, "hf"), per_device_train_batch_size=8,
                             max_steps=STEPS, use_cpu=True, ddp_backend="gloo",
                             report_to="none", logging_strategy="no", disable_tqdm=True,
                             **SAVING)
    Trainer(model=model, args=args, train_dataset=data,
            callbacks=[Steps(), *CALLBACKS]).train(resume_from_checkpoint=RESUME)
""")
HF_OURS = textwrap.dedent("""
    from elastic_magic.integrations.transformers import ElasticCallback
    SAVING, CALLBACKS, RESUME = {"save_strategy": "no"}, [ElasticCallback(every=EVERY)], None
""") + HF
HF_TORCHRUN = textwrap.dedent("""
    import os
    SAVING = {"save_strategy": "steps", "save_steps": EVERY}
    CALLBACKS = []
    RESUME = os.environ["TORCHELASTIC_RESTART_COUNT"] != "0" or None
""") + HF


def _values(quick: bool) -> dict[str, int]:
    return {"STEPS": KILL_AT + (3 if quick else 8), "SAMPLES": 960, "EVERY": EVERY,
            "KILL_AT": KILL_AT}


def _figures(out: Path, nproc: int, side: str) -> dict[str, float]:
    """From the kill to the restart's first step on every rank; the steps trained again."""
    recovered = max(cells.every(out, "step1", nproc)) - cells.every(out, "kill", 1)[0]
    resumed = [p.name.split("_")[1] for p in out.iterdir() if p.name.startswith("from1_")]
    if len(resumed) != 1:
        raise RuntimeError(f"no resumed step stamped in {out}")
    return {side: recovered, f"{side}_steps_lost": float(KILL_AT - int(resumed[0]))}


def _recovery(ours: str, theirs: str, nproc: int, quick: bool) -> dict[str, float]:
    cells.set_env()
    values = _values(quick)
    # the pool learns the cell's imports: the timed run forks from them
    warm_up(cells.STAMP + ours, nproc, namespace=cells.namespace(scratch(), {**values,
                                                                            "KILL_AT": -1}))
    out = scratch()
    launch(cells.STAMP + ours, nproc, namespace=cells.namespace(out, values), max_restarts=1)
    torchrun_out, _ = cells.run_torchrun(theirs, nproc, values, "--max-restarts=1",
                                         "--monitor-interval=0.1",
                                         env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert stamps(out, "kill_") and stamps(torchrun_out, "kill_")
    return {**_figures(out, nproc, "elastic_magic"), **_figures(torchrun_out, nproc, "torchrun")}


def lightning_recovery(nproc: int, quick: bool) -> dict[str, float]:
    return _recovery(LIGHTNING_OURS, LIGHTNING_TORCHRUN, nproc, quick)


def hf_recovery(nproc: int, quick: bool) -> dict[str, float]:
    return _recovery(HF_OURS, HF_TORCHRUN, nproc, quick)
