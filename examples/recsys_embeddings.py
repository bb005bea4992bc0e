"""Recommender with sparse embedding tables in mixed precision, on one or more processes.

    python examples/recsys_embeddings.py --epochs 3
    torchrun --nproc_per_node=2 examples/recsys_embeddings.py --epochs 3

The recommender workflow of the mixed precision guides: embedding tables and the dense MLP
are split (``split_embedding_parameters``) and get their own optimizers, ``SparseAdam`` for
the tables' sparse gradients and ``Adam`` for the rest, under one loss scale
(``LossScaleOptimizer([SparseAdam, Adam])``: one backward, one finiteness check, both step
or both skip). Under ``torchrun`` each process trains on its share of every global batch,
DDP all-reduces the dense and the sparse gradients, and every rank agrees on which steps to
skip, so the replicas stay identical. Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec import distributed as mpd


def log(*values: Any) -> None:
    if mpd.is_main_process():
        print(*values, flush=True)


def click_data(
    n: int, table_sizes: tuple[int, ...], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic clicks: each id has a hidden score; a sample is clicked when its ids' scores
    add up to more than 0. The same on every rank (same seed)."""
    g = torch.Generator().manual_seed(seed)
    scores = [torch.randn(size, generator=g) for size in table_sizes]
    ids = torch.stack([torch.randint(0, size, (n,), generator=g) for size in table_sizes], 1)
    logit = sum(s[ids[:, j]] for j, s in enumerate(scores))
    return ids, (torch.as_tensor(logit) > 0).float()


def replica_digest(opt: mp.LossScaleOptimizer) -> str:
    """A hash of the float32 masters (and plain parameters): equal on every rank when the
    replicas are bitwise identical."""
    h = hashlib.sha256()
    for p in opt.master_params():
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train(args: argparse.Namespace) -> dict[str, Any]:
    world = mpd.world_size()
    tables = (args.table_size, args.table_size, args.table_size // 10)
    ids, clicks = click_data(args.samples, tables, args.seed)
    cut = int(0.8 * len(ids))

    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP broadcasts anyway)
    model = mp.models.Recommender(tables, dim=args.dim, hidden=args.hidden, sparse=True)
    model = mp.auto_mixed_precision(model, args.policy, args.level)
    emb, dense = mp.split_embedding_parameters(model)
    # SparseAdam for the tables: Adam's dense moments would be updated for every row on
    # every step; SparseAdam touches only the rows a batch looked up.
    opt = mp.LossScaleOptimizer(
        [torch.optim.SparseAdam(emb, lr=args.emb_lr), torch.optim.Adam(dense, lr=args.lr)]
    )
    # DDP for the forward/backward (gradients averaged over ranks, sparse ones included);
    # passing the optimizer also sends rank 0's float32 masters to the other ranks.
    # fp32_allreduce: the 16-bit dense gradients are summed in float32 (fewer roundings).
    # (Sparse tables stay float32 under float16 policies: PyTorch cannot add float16
    # sparse tensors on a CPU.)
    net: nn.Module = (
        mpd.distributed_data_parallel(model, opt, fp32_allreduce=True) if world > 1 else model
    )
    local_batch = mpd.check_batch(args.batch_size)  # batch_size is global
    log(
        f"world size {world}, policy {args.policy} {args.level}, global batch "
        f"{args.batch_size} ({local_batch} per process), {len(emb)} tables "
        f"{[tuple(p.shape) for p in emb]}, {len(dense)} dense tensors, {opt.loss_scaler}"
    )

    epoch_losses, skipped, sparse = [], 0, False
    for epoch in range(args.epochs):
        net.train()
        # The same permutation on every rank; each takes its share, as DistributedSampler.
        order = torch.randperm(cut, generator=torch.Generator().manual_seed(args.seed + epoch))
        loss_sum, count = 0.0, 0
        for idx in mpd.shard(order).split(local_batch):
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(net(ids[idx]), clicks[idx])
            opt.backward(loss)
            grad = model.tables[0].weight.grad
            sparse = sparse or bool(grad is not None and grad.is_sparse)
            result = opt.step()  # every rank skips the same steps (found_inf is all-reduced)
            skipped += int(result.skipped)
            loss_sum += loss.item() * len(idx)
            count += len(idx)
        total, samples = mpd.all_reduce_sum([loss_sum, float(count)])
        epoch_losses.append(total / samples)
        log(
            f"epoch {epoch + 1}/{args.epochs}: loss {epoch_losses[-1]:.4f}, loss scale "
            f"{opt.loss_scaler.get_scale():g}, skipped steps so far {skipped}"
        )

    # Each rank scores its share of the held-out clicks; the counts are summed.
    net.eval()
    mine = mpd.shard(torch.arange(cut, len(ids)), pad=False)
    with torch.no_grad():
        correct = ((net(ids[mine]) > 0).float() == clicks[mine]).sum().item()
    right, seen = mpd.all_reduce_sum([float(correct), float(len(mine))])
    accuracy = right / seen
    baseline = max(clicks[cut:].mean().item(), 1 - clicks[cut:].mean().item())

    digest = replica_digest(opt)
    digests = [digest]
    if world > 1:
        digests = [""] * world
        dist.all_gather_object(digests, digest)
    identical = len(set(digests)) == 1
    log(
        f"test accuracy {accuracy:.3f} (majority class {baseline:.3f}); sparse embedding "
        f"gradients: {sparse}; replicas identical on {world} process(es): {identical}"
    )
    return {
        "world_size": world,
        "losses": epoch_losses,
        "test_accuracy": accuracy,
        "majority_baseline": baseline,
        "loss_scale": opt.loss_scaler.get_scale(),
        "skipped_steps": skipped,
        "sparse_gradients": sparse,
        "replicas_identical": identical,
        "mean_first_last": (statistics.fmean(epoch_losses[:1]), epoch_losses[-1]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="Sparse embeddings + MLP in mixed precision.")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128, help="global, over all ranks")
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--table-size", type=int, default=500)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--emb-lr", type=float, default=3e-2)
    parser.add_argument("--policy", default="mixed_float16")
    parser.add_argument("--level", default="O2")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    launched = mpd.init_from_env()  # False when not started by torchrun with 2+ processes
    figures = train(args)  # on an error, torchrun ends the other ranks
    if launched:
        mpd.shutdown()
    return figures


if __name__ == "__main__":
    main()
