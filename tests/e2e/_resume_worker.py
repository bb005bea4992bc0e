"""Run by test_resume.py in fresh processes: train, stop, resume, and write what came out."""

from __future__ import annotations

import sys

import torch
from torch import nn

import mixprec as mp
from tests.conftest import Interrupt


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(160, 32, generator=g)
    y = torch.randint(0, 10, (160,), generator=g)
    x[7] = 1e6  # overflows float16 in the first layer: the batch holding it is skipped
    return x, y


def trainer() -> mp.Trainer:
    m = model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    return mp.Trainer(m, "cross_entropy", opt, policy="mixed_float16", level="O2", device="cpu")


def outcome(m: nn.Module, opt: mp.LossScaleOptimizer, extra: dict) -> dict:
    return {"model": m.state_dict(), "optimizer": opt.state_dict(), **extra}


def main(mode: str, ckpt: str, out: str) -> None:
    torch.manual_seed(123)  # shuffling and dropout
    x, y = data()
    if mode.startswith("fit"):
        t = trainer()
        callbacks = []
        if mode == "fit-part":
            callbacks = [mp.ModelCheckpoint(ckpt, every_n_epochs=None, every_n_steps=13),
                         Interrupt(13)]  # fmt: skip
        resume = f"{ckpt}/step-00000013.safetensors" if mode == "fit-resume" else None
        try:
            t.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=callbacks,
                  resume_from=resume)  # fmt: skip
        except KeyboardInterrupt:
            return
        extra = {"skipped": t.optimizer.loss_scaler.state.skipped_steps, "step": t.global_step}
        torch.save(outcome(t.model, t.optimizer, extra), out)
        return
    # A custom loop: batches drawn from the global RNG, so the RNG state must resume too.
    m = mp.auto_mixed_precision(model(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.Adam(m.parameters(), lr=1e-2))
    start, stop = 0, 20
    if mode == "loop-part":
        stop = 10
    if mode == "loop-resume":
        start = mp.load_checkpoint(ckpt, m, opt, restore_rng=True).trainer_state["step"]
    for _ in range(start, stop):
        idx = torch.randint(0, len(x), (16,))
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(m(x[idx]), y[idx]))
        opt.step()
    if mode == "loop-part":
        mp.save_checkpoint(ckpt, m, opt, trainer_state={"step": stop})
        return
    torch.save(outcome(m, opt, {"skipped": opt.loss_scaler.state.skipped_steps}), out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
