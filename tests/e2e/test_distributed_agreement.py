"""Two gloo processes: an overflow on rank 1 only makes every rank skip the same steps."""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch import nn

import mixprec as mp
from tests.conftest import classification_data, make_mlp

STEPS = 6
BLOWN_UP = {2, 4}  # steps at which rank 1's loss is inf


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
        opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        ref = make_mlp()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        scaler = mp.GradScaler("cpu", init_scale=2.0**10)
        x, y = classification_data(n=32, seed=10 + rank)  # different data on each rank
        ours, theirs = [], []
        for step in range(STEPS):
            blow_up = float("inf") if rank == 1 and step in BLOWN_UP else 1.0
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(model(x), y) * blow_up)
            ours.append(opt.step().applied)

            ref_opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = ref(x)
            scaler.scale(nn.functional.cross_entropy(out.float(), y) * blow_up).backward()
            before = [p.detach().clone() for p in ref.parameters()]
            scaler.step(ref_opt)
            scaler.update()
            theirs.append(not torch.equal(before[0], next(ref.parameters())))
        torch.save(
            {
                "opt": ours,
                "opt_scale": opt.loss_scaler.get_scale(),
                "scaler": theirs,
                "scaler_scale": scaler.get_scale(),
            },
            Path(out_dir) / f"{rank}.pt",
        )
    finally:
        mp.distributed.shutdown()


def test_every_rank_skips_the_steps_one_rank_overflowed(tmp_path):
    tmp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    expected = [step not in BLOWN_UP for step in range(STEPS)]
    for r in results:
        assert r["opt"] == expected
        assert r["scaler"] == expected
    assert results[0]["opt_scale"] == results[1]["opt_scale"] == 2.0**16 / 4
    assert results[0]["scaler_scale"] == results[1]["scaler_scale"] == 2.0**10 / 4
