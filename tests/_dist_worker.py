"""Run under torchrun (2 processes, gloo) by test_distributed.py: each scenario writes what
every rank saw to OUT/<scenario>-<rank>.pt for the test to compare."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec as mp
from mixprec import distributed as mpd
from mixprec.float8 import cpu_kernel_error
from tests.conftest import Interrupt, classification_data, make_mlp

CE = nn.functional.cross_entropy


def global_batch(seed: int = 5):
    return classification_data(n=64, seed=seed)


def overflow_agreement(out: Path, rank: int) -> None:
    """Different data per rank; rank 1's loss is inf at steps 2 and 4."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ddp = mpd.distributed_data_parallel(model, opt)
    x, y = classification_data(n=32, seed=10 + rank)
    applied, scales = [], []
    for step in range(6):
        opt.zero_grad()
        blow = float("inf") if rank == 1 and step in (2, 4) else 1.0
        opt.backward(CE(ddp(x), y) * blow)
        result = opt.step()
        applied.append(result.applied)
        scales.append(opt.loss_scaler.get_scale())
    masters = [m.detach().clone() for _, m in opt.master_weights()]
    torch.save({"applied": applied, "scales": scales, "model": model.state_dict(),
                "masters": masters}, out / f"overflow-{rank}.pt")  # fmt: skip


def ddp_losses(out: Path, rank: int, fp32_allreduce: bool, level: str = "O2") -> None:
    """The global batch split across ranks; the global loss per step."""
    x, y = global_batch()
    mine = slice(rank, None, 2)
    policy = "bfloat16" if level == "O3" else "mixed_bfloat16"
    model = mp.auto_mixed_precision(make_mlp(), policy, level)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ddp = mpd.distributed_data_parallel(model, opt, fp32_allreduce=fp32_allreduce)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = CE(ddp(x[mine]), y[mine])
        opt.backward(loss)
        opt.step()
        losses.append(mpd.all_reduce_sum([loss.item()])[0] / 2)
    name = ("ddp32" if fp32_allreduce else "ddp") + ("" if level == "O2" else f"-{level}")
    torch.save({"losses": losses, "model": model.state_dict()}, out / f"{name}-{rank}.pt")


def fsdp_losses(out: Path, rank: int, policy: str) -> None:
    """FSDP2 with the policy's MixedPrecisionPolicy. The head's weight (1x32) and bias (1,)
    shard to nothing on rank 1: a rank with no gradients in that module."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                          nn.Linear(32, 1))  # fmt: skip
    x, _ = global_batch()
    target = x.sum(dim=1, keepdim=True) / 8
    mine = slice(rank, None, 2)
    mixed = mpd.fsdp_mixed_precision(policy)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=mixed)
    fully_shard(model, mp_policy=mixed)
    # What a LossScaleOptimizer over the shards picks by itself (float16: no scaling left
    # 92% of the gradients zero, unsaid).
    default = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05)).loss_scaler
    scaler = mp.DynamicLossScaler() if policy == "mixed_float16" else mp.NoOpLossScaler()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                loss_scaler=scaler, max_grad_norm=10.0)  # fmt: skip
    losses, applied = [], []
    for _ in range(8):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[mine]), target[mine])
        opt.backward(loss)
        applied.append(opt.step().applied)
        losses.append(mpd.all_reduce_sum([loss.item()])[0] / 2)
    local = model[4].weight.to_local().numel()
    # An O2 model sharded: its first step died in torch's raw _foreach_copy_ error.
    o2 = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    fully_shard(o2, mp_policy=mixed)
    try:
        mp.LossScaleOptimizer(torch.optim.SGD(o2.parameters(), lr=0.05))
        o2_refused = None
    except mp.ArgumentError as err:
        o2_refused = str(err)
    try:  # one file of one rank's shards, or the raw "invalid python storage" error
        mp.save_checkpoint(out / f"fsdp-{rank}.safetensors", model, opt)
        refused = None
    except mp.ArgumentError as err:
        refused = str(err)
    torch.save({"losses": losses, "applied": applied, "head_local": local,
                "default_scaler": type(default).__name__, "refused": refused,
                "o2_refused": o2_refused},
               out / f"fsdp-{policy}-{rank}.pt")  # fmt: skip


def float8_model() -> nn.Module:
    """Dimensions float8 takes (multiples of 16); the head stays bfloat16."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 10))  # fmt: skip


def float8_losses(out: Path, rank: int, kind: str) -> None:
    """``ddp``: mixed_float8 at O2 under DDP. ``fsdp``: at O1 (float32 weights) under FSDP2
    with torchao's float8 all-gather (the sharded weights are gathered in float8)."""
    from torch.distributed.fsdp import fully_shard

    x, y = global_batch()
    mine = slice(rank, None, 2)
    if kind == "ddp":
        model = mp.auto_mixed_precision(float8_model(), "mixed_float8", "O2",
                                        float8=mp.Float8Options(min_features=16))  # fmt: skip
        opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        run = mpd.distributed_data_parallel(model, opt)
    else:
        options = mp.Float8Options(min_features=16, fsdp_float8_all_gather=True)
        model = mp.auto_mixed_precision(float8_model(), "mixed_float8", "O1", float8=options)
        mixed = mpd.fsdp_mixed_precision("mixed_float8")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mp_policy=mixed)
        run = fully_shard(model, mp_policy=mixed)
        opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    losses, applied = [], []
    for _ in range(6):
        opt.zero_grad()
        loss = CE(run(x[mine]), y[mine])
        opt.backward(loss)
        applied.append(opt.step().applied)
        losses.append(mpd.all_reduce_sum([loss.item()])[0] / 2)
    weight = model[0].weight
    local = weight.to_local() if kind == "fsdp" else weight  # type: ignore[operator]
    # DDP: every rank holds the whole model, which must be identical across ranks.
    state = {k: v.detach().clone() for k, v in model.state_dict().items()} if kind == "ddp" else {}
    torch.save({"losses": losses, "applied": applied, "weight_type": type(local).__name__,
                "state": state}, out / f"fp8-{kind}-{rank}.pt")  # fmt: skip


def mismatched_data(out: Path, rank: int) -> None:
    """Rank 1 passes fewer samples: both ranks must raise the same ValueError, with no
    collective left half-done (the next scenario still runs)."""
    x, y = classification_data(n=64 if rank == 0 else 48, seed=3)
    model = make_mlp()
    t = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), 0.1),
                   policy="mixed_bfloat16", device="cpu")  # fmt: skip
    try:
        t.fit(x, y, batch_size=16, epochs=1, verbose=0)
        message = None
    except ValueError as err:
        message = str(err)
    # resume_from given to rank 0 alone: its load's collective met the others' next one.
    x, y = classification_data(n=64, seed=3)
    try:
        resume = out / "absent.safetensors" if rank == 0 else None
        t.fit(x, y, batch_size=16, epochs=1, verbose=0, resume_from=resume)
        resumed_alone = None
    except ValueError as err:
        resumed_alone = str(err)
    # Each rank's own shard of the same size, where the global data is meant: rank 1's
    # half was never trained on.
    x, y = classification_data(n=64, seed=3 + rank)
    try:
        t.fit(x, y, batch_size=16, epochs=1, verbose=0)
        own_shards = None
    except ValueError as err:
        own_shards = str(err)
    torch.save({"message": message, "resumed-alone": resumed_alone, "own-shards": own_shards},
               out / f"mismatch-{rank}.pt")  # fmt: skip


def state_loaded_on_rank_zero(out: Path, rank: int) -> None:
    """A float16 checkpoint (scale backed off to 256, AdamW's moments) loaded on rank 0
    alone, then distributed_data_parallel(model, opt): the masters were sent, the scale and
    the moments were not, and the ranks drifted apart unsaid."""
    path = out / "rank0-state.safetensors"
    # Made on both ranks alike (a step agrees on overflows with the other ranks).
    model = mp.auto_mixed_precision(make_mlp(seed=5), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = global_batch()
    for _ in range(2):
        opt.zero_grad()
        opt.backward(CE(model(x), y))
        opt.step()
    opt.loss_scaler.set_scale(256.0)
    if rank == 0:
        mp.save_checkpoint(path, model, opt)
    dist.barrier()
    model = mp.auto_mixed_precision(make_mlp(seed=0), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    if rank == 0:
        mp.load_checkpoint(path, model, opt)
    ddp = mpd.distributed_data_parallel(model, opt)
    x, y = global_batch()
    for _ in range(3):
        opt.zero_grad()
        opt.backward(CE(ddp(x[rank::2]), y[rank::2]))
        opt.step()
    moments = [s["exp_avg"].clone() for s in opt.optimizers[0].state.values()]
    torch.save({"scale": opt.loss_scaler.get_scale(), "moments": moments,
                "masters": [m.detach().clone() for _, m in opt.master_weights()]},
               out / f"rank0-state-{rank}.pt")  # fmt: skip


def parted(out: Path, rank: int) -> None:
    """Ranks that part ways: resumed from different checkpoints (a hang in DDP's
    all-reduce; at one position, different weights trained on unsaid), and a stop asked on
    rank 0 alone (a raw gloo abort)."""
    x, y = classification_data(n=64, seed=3)
    for name, seed in (("a", 0), ("b", 1)):
        t = _small_trainer()
        torch.manual_seed(seed)  # another shuffle: other weights at the same position
        t.fit(x, y, batch_size=16, epochs=2, verbose=0,
              callbacks=[mp.ModelCheckpoint(out / f"parted-{name}", every_n_epochs=1)])  # fmt: skip
    results: dict[str, object] = {}
    choices = {
        "position": ("a/epoch-0002", "a/epoch-0001"),
        "weights": ("a/epoch-0001", "b/epoch-0001"),
    }
    for case, files in choices.items():
        path = out / f"parted-{files[rank]}.safetensors"
        try:
            _small_trainer().fit(x, y, batch_size=16, epochs=3, verbose=0, resume_from=path)
            results[case] = None
        except ValueError as err:
            results[case] = str(err)

    class StopOnRankZero(mp.Callback):
        def on_train_batch_end(self, batch: int, logs=None) -> None:
            if rank == 0 and batch == 1:
                self.trainer.stop_training = True

    t = _small_trainer()
    t.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[StopOnRankZero()])
    results["stopped_at"] = t.global_step
    torch.save(results, out / f"parted-{rank}.pt")


def trainer_and_resume(out: Path, rank: int) -> None:
    x, y = classification_data(n=256, seed=3)
    results = {}
    for name in ("full", "first", "resumed"):
        torch.manual_seed(0)
        model = make_mlp()
        t = mp.Trainer(model, "cross_entropy", torch.optim.Adam(model.parameters(), 1e-2),
                       policy="mixed_bfloat16", device="cpu")  # fmt: skip
        assert t.distributed
        ckpt = mp.ModelCheckpoint(out / "ckpt", every_n_epochs=1, keep_last=5)
        if name == "full":
            history = t.fit(x, y, batch_size=32, epochs=2, verbose=0)
            results["history"] = history.history
        elif name == "first":
            t.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[ckpt])
        else:
            dist.barrier()  # rank 0's checkpoint is on disk
            t.fit(x, y, batch_size=32, epochs=2, verbose=0,
                  resume_from=out / "ckpt" / "epoch-0001.safetensors")  # fmt: skip
        results[name] = {k: v.clone() for k, v in model.state_dict().items()}
        results[f"{name}-eval"] = t.evaluate(x, y)
    torch.save(results, out / f"trainer-{rank}.pt")


def _small_trainer() -> mp.Trainer:
    model = make_mlp()
    return mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), 1e-3),
                      policy="mixed_bfloat16", device="cpu")  # fmt: skip


def trainer_resumed_mid_epoch(out: Path, rank: int) -> None:
    """Stopped after a step checkpoint at step 4 of 8 and resumed: the epoch's loss must
    count every rank's batches before the checkpoint once (the ranks' shares differ 100x)."""
    x, y = classification_data(n=128, seed=3)
    x[1::2] *= 100.0  # rank 1's share (unshuffled): a far larger loss
    losses = {}
    for name in ("full", "first", "resumed"):
        t = _small_trainer()
        ckpt = mp.ModelCheckpoint(out / "mid", every_n_epochs=None, every_n_steps=4)
        if name == "first":
            with contextlib.suppress(KeyboardInterrupt):
                t.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
                      callbacks=[ckpt, Interrupt(4)])  # fmt: skip
            dist.barrier()  # rank 0's checkpoint is on disk
            continue
        resume = out / "mid" / "step-00000004.safetensors" if name == "resumed" else None
        history = t.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
                        resume_from=resume, callbacks=[ckpt])  # fmt: skip
        losses[name] = history.history["loss"][0]
    # From the epoch's last step (8 of 8): no batch left, rank 0 alone holds the sums.
    t = _small_trainer()
    history = t.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
                    resume_from=out / "mid" / "step-00000008.safetensors")  # fmt: skip
    losses["resumed-at-the-end"] = history.history["loss"][0]
    torch.save(losses, out / f"mid-epoch-{rank}.pt")


def _dropout_trainer(accumulation: int = 1) -> mp.Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 10))
    return mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), 0.1),
                      policy="mixed_bfloat16", device="cpu",
                      accumulation_steps=accumulation)  # fmt: skip


class _Noisy(torch.utils.data.Dataset):
    """Samples with noise drawn from torch's generator in the main process, per rank."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.1 * torch.randn(self.x.shape[1]), self.y[i]


class _DrawsAtEpochEnd(mp.Callback):
    """A callback that draws from torch's RNG at an epoch's end, before the checkpoint."""

    def on_epoch_end(self, epoch: int, logs: dict) -> None:
        torch.rand(3)


def _resumed_as_uninterrupted(
    out: Path, rank: int, tag: str, seed: int, data, extra, accumulation: int = 1
) -> dict:
    """The weights after 2 epochs uninterrupted, and resumed from an epoch's end and from
    a step checkpoint (step 3 of 8), all with ``torch.manual_seed(seed)`` after the model."""
    runs = {
        "full": ({}, None),
        "epoch": ({"every_n_epochs": 1}, "epoch-0001.safetensors"),
        "step": ({"every_n_epochs": None, "every_n_steps": 3}, "step-00000003.safetensors"),
    }
    results = {}
    for name, (every, resume_name) in runs.items():
        for part in ("first", "resumed") if resume_name else ("full",):
            t = _dropout_trainer(accumulation)
            torch.manual_seed(seed)
            ckpt = mp.ModelCheckpoint(out / f"{tag}-{name}", **every)
            if part == "first":
                stop = [Interrupt(3)] if name == "step" else []
                with contextlib.suppress(KeyboardInterrupt):
                    t.fit(*data(), batch_size=32, epochs=1, verbose=0,
                          callbacks=[ckpt, *extra(), *stop])  # fmt: skip
                dist.barrier()  # rank 0's checkpoint is on disk
                continue
            resume = out / f"{tag}-{name}" / resume_name if resume_name else None
            t.fit(*data(), batch_size=32, epochs=2, verbose=0, resume_from=resume,
                  callbacks=extra())  # fmt: skip
            results[name] = {k: v.clone() for k, v in t.model.state_dict().items()}
    return results


def ranks_seeded_apart(out: Path, rank: int) -> None:
    """Resumed from an epoch's end and from a step checkpoint, each rank must draw as it
    would have: ranks seeded per rank (their own dropout masks), a DataLoader shuffling per
    rank, and ranks seeded alike with a callback drawing before the checkpoint is written."""
    x, y = classification_data(n=256, seed=3)
    share = x[rank::2], y[rank::2]  # each rank's own 128 samples, shuffled by its own RNG
    loader = DataLoader(TensorDataset(*share), batch_size=16, shuffle=True)
    results: dict[str, object] = {
        "apart": _resumed_as_uninterrupted(out, rank, "apart", 100 + rank, lambda: (x, y), list),
        "loader": _resumed_as_uninterrupted(
            out, rank, "loader", 100 + rank, lambda: (loader,), list
        ),
        "alike": _resumed_as_uninterrupted(
            out, rank, "alike", 0, lambda: (x, y), lambda: [_DrawsAtEpochEnd()]
        ),
        # Accumulation reads a batch ahead, whose noise each rank drew before its step
        # checkpoint: each rank's state from before that read is kept.
        "ahead": _resumed_as_uninterrupted(
            out,
            rank,
            "ahead",
            100 + rank,
            lambda: (DataLoader(_Noisy(*share), batch_size=8, shuffle=True),),
            list,
            2,
        ),
    }
    # A checkpoint of rank 0's state alone (save_checkpoint by hand): said, not silent.
    t = _dropout_trainer()
    if rank == 0:
        mp.save_checkpoint(out / "apart-by-hand.safetensors", t.model, t.optimizer,
                           trainer_state=t.resume_state())  # fmt: skip
    dist.barrier()
    torch.manual_seed(100 + rank)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t.fit(x, y, batch_size=32, epochs=1, verbose=0,
              resume_from=out / "apart-by-hand.safetensors")  # fmt: skip
    results["warned"] = [str(w.message) for w in seen if "random states differ" in str(w.message)]
    torch.save(results, out / f"apart-{rank}.pt")


class _Batches:
    """A loader without a length (as an IterableDataset's), of ``n`` batches of 8."""

    def __init__(self, n: int) -> None:
        self.x, self.y = classification_data(n=8 * n, seed=3)

    def __iter__(self):
        return iter(zip(self.x.split(8), self.y.split(8), strict=True))


def uneven_loaders(out: Path, rank: int) -> None:
    """Rank 1's length-less loader has 2 batches more: rank 0 left the epoch and rank 1
    waited in DDP's all-reduce (gloo's raw error, or a hang under NCCL)."""
    t = _small_trainer()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        history = t.fit(_Batches(5 + 2 * rank), epochs=2, verbose=0)
    said = [str(w.message) for w in seen if "batches left" in str(w.message)]
    weights = {k: v.clone() for k, v in t.model.state_dict().items()}
    torch.save({"steps": t.global_step, "warned": said, "model": weights,
                "loss": history.history["loss"]}, out / f"uneven-{rank}.pt")  # fmt: skip


def checkpoint_on_rank_zero_alone(out: Path, rank: int) -> None:
    """A ModelCheckpoint(every_n_steps) passed to rank 0's fit only: no collective of one
    rank (it hung or aborted), a warning instead of summed sums."""
    x, y = classification_data(n=96, seed=3)
    t = _small_trainer()
    ckpt = mp.ModelCheckpoint(out / "rank0", every_n_epochs=None, every_n_steps=3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[ckpt] if rank == 0 else [])
    said = [str(w.message) for w in seen if "differs between ranks" in str(w.message)]
    torch.save({"warned": said}, out / f"rank0-only-{rank}.pt")


def ddp_after_a_load_on_rank_zero(out: Path, rank: int) -> None:
    """Weights loaded on rank 0 alone, then DDP (without the optimizer) broadcasts them:
    rank 0's masters no longer match its weights, the other ranks' do."""
    _ddp_without_its_optimizer(out, rank, "load-on-zero", load_on_zero=True)


def recommender(out: Path, rank: int) -> None:
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(mp.models.Recommender(sparse=True), "mixed_bfloat16", "O2")
    emb, dense = mp.split_embedding_parameters(model)
    opt = mp.LossScaleOptimizer([torch.optim.SparseAdam(emb, lr=1e-2),
                                 torch.optim.Adam(dense, lr=1e-2)])  # fmt: skip
    ddp = mpd.distributed_data_parallel(model, opt)
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randint(0, s, (128,), generator=g) for s in (1000, 1000, 100)], 1)
    clicks = (ids[:, 2] % 2).float()  # learnable from the third table
    mine = slice(rank, None, 2)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(ddp(ids[mine]), clicks[mine])
        opt.backward(loss)
        opt.step()
        losses.append(mpd.all_reduce_sum([loss.item()])[0] / 2)
    sparse_grad = model.tables[0].weight.grad is not None and model.tables[0].weight.grad.is_sparse
    torch.save({"losses": losses, "model": model.state_dict(), "sparse": sparse_grad},
               out / f"recsys-{rank}.pt")  # fmt: skip


def subgroup_allreduce(out: Path, rank: int) -> None:
    """DDP over a data-parallel subgroup of one rank each: with the float32 all-reduce the
    gradients stay each rank's own, as without it."""
    import torch.distributed as dist

    groups = [dist.new_group([0]), dist.new_group([1])]
    grads = {}
    for fp32 in (False, True):
        torch.manual_seed(0)
        model = mp.auto_mixed_precision(nn.Linear(4, 1), "mixed_bfloat16", "O2")
        ddp = mpd.distributed_data_parallel(model, fp32_allreduce=fp32, process_group=groups[rank])
        ddp(torch.full((2, 4), float(rank + 1))).float().sum().backward()
        grads[fp32] = model.weight.grad.float().clone()
    torch.save(grads, out / f"subgroup-{rank}.pt")


def ddp_without_its_optimizer(out: Path, rank: int) -> None:
    """Ranks initialised differently, the optimizer built before the wrap and not passed
    to it: DDP broadcasts rank 0's 16-bit weights, and each rank's masters must follow."""
    _ddp_without_its_optimizer(out, rank, "ddp-no-optimizer", load_on_zero=False)


def _ddp_without_its_optimizer(out: Path, rank: int, name: str, load_on_zero: bool) -> None:
    seed = 0 if load_on_zero else rank
    model = mp.auto_mixed_precision(make_mlp(seed=seed), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), 0.1))
    if load_on_zero and rank == 0:
        other = mp.auto_mixed_precision(make_mlp(seed=5), "mixed_bfloat16", "O2")
        model.load_state_dict(other.state_dict())
    ddp = mpd.distributed_data_parallel(model)
    x, y = global_batch()
    for _ in range(3):
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(ddp(x[rank::2]), y[rank::2]))
        opt.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save({"model": state}, out / f"{name}-{rank}.pt")


def plain_ddp_after_optimizer(out: Path, rank: int) -> None:
    """Ranks seeded apart, the optimizer built first, then torch's own DDP: its broadcast
    gave the other ranks rank 0's weights but left their masters rounded ones, and the
    replicas never agreed again."""
    model = mp.auto_mixed_precision(make_mlp(seed=rank), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    ddp = nn.parallel.DistributedDataParallel(model)
    x, y = global_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            opt.zero_grad()
            opt.backward(CE(ddp(x[rank::2]), y[rank::2]))
            opt.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    masters = [m.detach().clone() for _, m in opt.master_weights()]
    warned = [str(w.message) for w in caught if "replicas" in str(w.message)]
    # O1 has no masters to align: its first step has nothing to compare (it raised under
    # NCCL, whose group has no CPU tensors, when it compared anyway).
    o1 = mp.auto_mixed_precision(make_mlp(seed=rank), "mixed_bfloat16", "O1")
    o1_opt = mp.LossScaleOptimizer(torch.optim.SGD(o1.parameters(), lr=0.1))
    o1_ddp = nn.parallel.DistributedDataParallel(o1)
    o1_opt.backward(CE(o1_ddp(x[rank::2]), y[rank::2]))
    o1_applied = bool(o1_opt.step().applied)
    torch.save(
        {"model": state, "masters": masters, "warned": warned, "o1_applied": o1_applied},
        out / f"plain-ddp-{rank}.pt",
    )


def main(out: str) -> None:
    assert mpd.init_from_env(timeout_s=120)
    rank = mpd.rank()
    path = Path(out)
    try:
        overflow_agreement(path, rank)
        subgroup_allreduce(path, rank)
        ddp_without_its_optimizer(path, rank)
        plain_ddp_after_optimizer(path, rank)
        ddp_losses(path, rank, fp32_allreduce=False)
        ddp_losses(path, rank, fp32_allreduce=True)
        ddp_losses(path, rank, fp32_allreduce=False, level="O1")
        ddp_losses(path, rank, fp32_allreduce=True, level="O3")
        # float16 first: the bfloat16 shards after it must still get no loss scaling.
        fsdp_losses(path, rank, "mixed_float16")
        fsdp_losses(path, rank, "mixed_bfloat16")
        trainer_and_resume(path, rank)
        trainer_resumed_mid_epoch(path, rank)
        ranks_seeded_apart(path, rank)
        uneven_loaders(path, rank)
        checkpoint_on_rank_zero_alone(path, rank)
        ddp_after_a_load_on_rank_zero(path, rank)
        state_loaded_on_rank_zero(path, rank)
        mismatched_data(path, rank)
        parted(path, rank)
        recommender(path, rank)
        # The float8 extra, where this CPU has a float8 matmul (none below AVX512: the
        # float8 test is then skipped, with the reason, by conftest).
        torchao = importlib.util.find_spec("torchao") is not None
        if torchao and cpu_kernel_error(rowwise=False) is None:
            float8_losses(path, rank, "ddp")
            float8_losses(path, rank, "fsdp")
    finally:
        mpd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
