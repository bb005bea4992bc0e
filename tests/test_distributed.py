"""Two processes under torchrun with gloo on CPU: overflow agreement, DDP at O2 (and with a
float32 all-reduce), FSDP2 from a Policy (with a rank that holds no gradient shard), the
Trainer with a distributed checkpoint and resume, and sparse recommender embeddings. Each
is compared with a single process on the same global batch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec import distributed as mpd
from tests.conftest import classification_data, make_mlp, subprocess_env

WORKER = Path(__file__).with_name("_dist_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    env = subprocess_env(torchrun=True)
    # --standalone: a free port, so concurrent runs on one machine do not collide.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(WORKER), str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    def load(name: str) -> list[dict]:
        return [torch.load(out / f"{name}-{r}.pt", weights_only=False) for r in (0, 1)]

    return load


def equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_overflow_on_one_rank_skips_on_every_rank(runs):
    r0, r1 = runs("overflow")
    expected = [True, True, False, True, False, True]
    assert r0["applied"] == r1["applied"] == expected
    assert r0["scales"] == r1["scales"] and r0["scales"][-1] == 2.0**16 / 4
    assert equal_states(r0["model"], r1["model"])
    assert all(torch.equal(a, b) for a, b in zip(r0["masters"], r1["masters"], strict=True))


def _sgd_losses(model: nn.Module, steps: int) -> list[float]:
    """One process on the workers' global batch: the losses of ``steps`` SGD steps."""
    x, y = classification_data(n=64, seed=5)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses


def single_process_ddp_reference() -> list[float]:
    return _sgd_losses(mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2"), 8)


@pytest.mark.parametrize("name", ["ddp", "ddp32"])
def test_ddp_matches_one_process_on_the_global_batch(runs, name):
    r0, r1 = runs(name)
    assert r0["losses"] == r1["losses"] and equal_states(r0["model"], r1["model"])
    reference = single_process_ddp_reference()
    # Same global batch and gradients (averaged over ranks instead of over one batch);
    # bfloat16 weights round the same updates: measured differences below 1e-3.
    for ours, ref in zip(r0["losses"], reference, strict=True):
        assert abs(ours - ref) < 5e-3


@pytest.mark.parametrize("name", ["ddp-O1", "ddp32-O3"])
def test_ddp_at_other_levels_keeps_ranks_identical(runs, name):
    r0, r1 = runs(name)
    assert r0["losses"] == r1["losses"] and equal_states(r0["model"], r1["model"])
    assert r0["losses"][-1] < r0["losses"][0]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_fsdp2_matches_one_process(runs, policy):
    r0, r1 = runs(f"fsdp-{policy}")
    assert r0["losses"] == r1["losses"] and all(r0["applied"])
    assert r0["head_local"] == 32 and r1["head_local"] == 0  # rank 1: no shard, no gradient
    # The shards carry no tags: fsdp_mixed_precision's float16 policy brings the scaling.
    expected = "DynamicLossScaler" if policy == "mixed_float16" else "NoOpLossScaler"
    assert r0["default_scaler"] == r1["default_scaler"] == expected
    assert r0["refused"] == r1["refused"]
    assert r0["o2_refused"] == r1["o2_refused"]
    assert r0["o2_refused"].startswith(
        "param_groups[0]['params'][0] is a torch.bfloat16 DTensor shard: a model prepared at "
        "O2 or O3 and then sharded by fully_shard."
    )
    assert r0["refused"].startswith(
        "save_checkpoint(): the model's parameters are DTensor shards ('0.weight'; FSDP2's "
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                          nn.Linear(32, 1))  # fmt: skip
    x, _ = classification_data(n=64, seed=5)
    target = x.sum(dim=1, keepdim=True) / 8
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    reference = []
    for _ in range(8):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        reference.append(loss.item())
    # 16-bit compute against a float32 reference: within 1% of the loss (measured 0.2%).
    for ours, ref in zip(r0["losses"], reference, strict=True):
        assert abs(ours - ref) < 0.01 * ref


def single_process_float8(level: str) -> list[float]:
    from tests._dist_worker import float8_model

    model = mp.auto_mixed_precision(float8_model(), "mixed_float8", level,
                                    float8=mp.Float8Options(min_features=16))  # fmt: skip
    return _sgd_losses(model, 6)


@pytest.mark.parametrize(("kind", "level"), [("ddp", "O2"), ("fsdp", "O1")])
@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_float8_under_ddp_and_fsdp2_matches_one_process(runs, kind, level):
    """Issue 16 item 6. FSDP2 gathers the weights in float8 (torchao's float8 all-gather,
    which runs on gloo). Each rank scales its own half batch, so the losses differ from one
    process by the float8 rounding of different scales: measured 4.9e-4 (DDP and FSDP2
    alike); bound 2e-3."""
    pytest.importorskip("torchao")
    r0, r1 = runs(f"fp8-{kind}")
    assert all(r0["applied"]) and all(r1["applied"])
    if kind == "ddp":
        assert r0["state"] and equal_states(r0["state"], r1["state"])
    if kind == "fsdp":
        assert r0["weight_type"] == "WeightWithDynamicFloat8CastTensor"
    for ours, ref in zip(r0["losses"], single_process_float8(level), strict=True):
        assert abs(ours - ref) < 2e-3


def test_ranks_with_different_data_sizes_fail_on_every_rank_with_a_clear_error(runs):
    """Issue 15 item 8: this died in gloo's raw "collective mismatch" abort after ~10 s."""
    r0, r1 = runs("mismatch")
    assert r0["message"] == r1["message"]
    assert r0["message"].startswith(
        "fit()'s data differ between ranks (rank 0: samples_or_batches=64, batch_size=16, "
        "epochs=1, validation_samples=-1, resume_from=0, data_checksum="
    )
    assert "; rank 1: samples_or_batches=48, " in r0["message"]
    assert "every rank must pass the same global data, batch_size and epochs" in r0["message"]
    assert r0["resumed-alone"] == r1["resumed-alone"]
    assert "validation_samples=-1, resume_from=1, data_checksum=" in r0["resumed-alone"]
    assert r0["resumed-alone"].endswith("and resume_from on every rank or none")
    # Same sizes, each rank's own samples: rank 1's half was never trained on, unsaid.
    assert r0["own-shards"] == r1["own-shards"]
    assert r0["own-shards"].startswith("fit()'s data differ between ranks (rank 0: ")
    checksums = re.findall(r"data_checksum=(-?\d+)", r0["own-shards"])
    assert len(checksums) == 2 and checksums[0] != checksums[1]


def test_ranks_that_part_ways_are_told_or_kept_together(runs):
    r0, r1 = runs("parted")
    for case in ("position", "weights"):  # a hang, or different weights trained on unsaid
        assert r0[case] == r1[case]
        assert r0[case].startswith("the checkpoints resumed differ between ranks (rank 0: ")
        assert r0[case].endswith("every rank must resume from the same checkpoint file "
                                 "(ModelCheckpoint writes one, from rank 0)")  # fmt: skip
    assert "epoch=2" in r0["position"] and "epoch=1" in r0["position"]
    # A stop asked on rank 0 alone, after its second batch: every rank stops there (it was
    # a raw gloo abort on one rank and a connection reset on the other).
    assert r0["stopped_at"] == r1["stopped_at"] == 2


def test_a_checkpoint_loaded_on_rank_zero_alone_gives_every_rank_its_scale_and_moments(runs):
    r0, r1 = runs("rank0-state")
    assert r0["scale"] == r1["scale"] == 256.0  # 3 clean steps: no growth yet
    assert all(torch.equal(a, b) for a, b in zip(r0["moments"], r1["moments"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(r0["masters"], r1["masters"], strict=True))


def test_trainer_under_torchrun_checkpoints_and_resumes(runs):
    r0, r1 = runs("trainer")
    assert equal_states(r0["full"], r1["full"])  # ranks agree
    assert equal_states(r0["full"], r0["resumed"])  # resume == uninterrupted, bitwise
    assert r0["full-eval"] == r1["full-eval"] == r0["resumed-eval"]
    assert r0["history"]["loss"][1] < r0["history"]["loss"][0]


def test_a_mid_epoch_resume_reports_every_ranks_share_of_the_epoch(runs):
    """The checkpoint held rank 0's sums alone, which every rank then loaded: rank 0's
    batches before it were counted twice and rank 1's not at all."""
    r0, r1 = runs("mid-epoch")
    assert r0 == r1
    assert r0["resumed"] == pytest.approx(r0["full"], rel=1e-6)
    # From the epoch's last step the other ranks had no batch and no sums: they raised.
    assert r0["resumed-at-the-end"] == pytest.approx(r0["full"], rel=1e-6)


def test_each_rank_resumes_with_its_own_random_states(runs):
    """Every rank took rank 0's RNG state on resume: ranks seeded apart then drew rank 0's
    dropout masks, and a DataLoader shuffling per rank replayed rank 0's order. Ranks
    seeded alike whose callback drew before the checkpoint resumed from the state before
    that draw. Each went elsewhere than the uninterrupted run, without a word. With
    accumulation ("ahead"), a batch read ahead draws its noise before the checkpoint."""
    r0, r1 = runs("apart")
    for case in ("apart", "loader", "alike", "ahead"):
        for resumed in ("epoch", "step"):
            for r in (r0, r1):  # bitwise, as uninterrupted
                assert equal_states(r[case]["full"], r[case][resumed]), (case, resumed)
    # A checkpoint holding rank 0's state alone: rank 0 says so, once, naming torch's.
    assert len(r0["warned"]) == 1
    said = r0["warned"][0]
    assert "the ranks' torch, " in said and "every rank takes rank 0's" in said
    assert "(dropout masks)" in said
    assert r1["warned"] == []


def test_length_less_loaders_of_uneven_lengths_stop_together_and_say_so(runs):
    r0, r1 = runs("uneven")
    assert r0["steps"] == r1["steps"] == 10  # 5 batches an epoch, the shorter loader's
    assert equal_states(r0["model"], r1["model"])
    assert r0["loss"] == r1["loss"]
    assert r0["warned"] == []
    assert len(r1["warned"]) == 2  # once an epoch, by the rank with batches left
    assert "rank 1's loader has batches left after 5" in r1["warned"][0]


def test_a_step_checkpoint_on_rank_zero_alone_warns_and_does_not_hang(runs):
    r0, r1 = runs("rank0-only")
    assert len(r0["warned"]) == 1 and "differs between ranks" in r0["warned"][0]
    assert r1["warned"] == []  # said once, by rank 0


def test_ddp_after_weights_loaded_on_rank_zero_alone(runs):
    """Rank 0 decides: its weights broadcast by DDP, the other ranks' masters follow them
    (the first version of the master broadcast refused this common pattern)."""
    r0, r1 = runs("load-on-zero")
    assert equal_states(r0["model"], r1["model"])


def test_recommender_with_sparse_embeddings(runs):
    r0, r1 = runs("recsys")
    assert r0["sparse"] and equal_states(r0["model"], r1["model"])
    assert r0["losses"][-1] < 0.1 * r0["losses"][0]


def test_errors_without_a_hang():
    assert mpd.world_size() == 1 and mpd.is_main_process()
    assert mpd.check_batch(64) == 64
    for bad in (0, -4):  # returned as per-rank batches before
        with pytest.raises(mp.ArgumentError, match=rf"batch_size={bad} is invalid"):
            mpd.check_batch(bad)
    for bad in (-1, float("nan"), "300"):  # failed inside torch's init (or its timedelta)
        with pytest.raises(mp.ArgumentError, match=rf"timeout_s={bad!r} is invalid"):
            mpd.init_from_env(timeout_s=bad)
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        mpd.distributed_data_parallel(make_mlp())


def test_ddp_without_its_optimizer_keeps_the_ranks_together(runs):
    """The masters of an optimizer built before the wrap were each rank's own: the first
    step copied them over rank 0's broadcast weights, and the ranks drifted apart."""
    r0, r1 = runs("ddp-no-optimizer")
    assert equal_states(r0["model"], r1["model"])


def test_torchs_own_ddp_built_after_the_optimizer_gets_rank_zeros_masters(runs):
    """The masters behind DDP's broadcast weights were rank 0's exact values on rank 0 and
    their 16-bit rounding elsewhere: 670 of 2372 weights apart after 200 steps, unsaid."""
    r0, r1 = runs("plain-ddp")
    assert equal_states(r0["model"], r1["model"])
    assert all(torch.equal(a, b) for a, b in zip(r0["masters"], r1["masters"], strict=True))
    assert len(r0["warned"]) == 1 and "distributed_data_parallel(model, opt)" in r0["warned"][0]
    assert r1["warned"] == []  # said once, by rank 0
    assert r0["o1_applied"] and r1["o1_applied"]


def test_the_float32_allreduce_stays_in_ddps_process_group(runs):
    for rank, grads in enumerate(runs("subgroup")):
        own = torch.full((1, 4), 2.0 * (rank + 1))  # its own batch's gradient, not the mean
        assert torch.equal(grads[False], own) and torch.equal(grads[True], own)


@pytest.mark.parametrize(("items", "ranks"), [(3, 8), (5, 2), (1, 4)])
def test_shard_gives_every_rank_as_many_as_distributed_sampler(monkeypatch, items, ranks):
    from torch.utils.data import DistributedSampler

    monkeypatch.setattr(mpd, "world_size", lambda: ranks)
    for r in range(ranks):
        monkeypatch.setattr(mpd, "rank", lambda r=r: r)
        sampler = DistributedSampler(range(items), num_replicas=ranks, rank=r, shuffle=False)
        assert mpd.shard(torch.arange(items)).tolist() == list(sampler)


def test_batch_must_divide_and_backend_must_exist(monkeypatch):
    monkeypatch.setattr(mpd, "world_size", lambda: 3)
    with pytest.raises(ValueError, match=r"batch_size=64 does not divide across world_size=3"):
        mpd.check_batch(64)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(mpd.dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"backend='nccl' is not available here; available:"):
        if torch.cuda.is_available():
            pytest.skip("NCCL may be available")
        mpd.init_from_env(backend="nccl")


def test_more_nccl_ranks_than_gpus_is_a_clear_error(monkeypatch):
    # torchrun --nproc_per_node=2 on a one-GPU machine: rank 1 would set a device CUDA has not.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(mpd.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(mpd.dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError) as raised:
        mpd.init_from_env(backend="nccl")
    assert str(raised.value) == (
        "backend='nccl': LOCAL_RANK=1 needs a GPU of its own, and this process sees 1; start "
        "at most 1 per node (torchrun --nproc_per_node), or run every rank on the CPU with "
        "backend='gloo' (or with the GPUs hidden, CUDA_VISIBLE_DEVICES=, and backend='auto')"
    )


def test_checksums_of_equal_values_are_equal_in_every_process():
    """The resume check compared hash(total): a NaN's hash is its object's, so ranks with the
    same NaN weights were told their checkpoints differ."""
    a, b = float("nan"), float("nan")
    assert hash(a) != hash(b)  # what a rank would have sent
    assert mpd.float_key(a) == mpd.float_key(b)
    assert mpd.float_key(1.5) != mpd.float_key(1.5000000000000002)
    assert -(2**63) <= mpd.float_key(-1e300) < 2**63  # an int64 for the collective


def test_fsdp_policy_mapping():
    mixed = mpd.fsdp_mixed_precision("mixed_bfloat16")
    assert mixed.param_dtype == torch.bfloat16 and mixed.reduce_dtype == torch.float32
    assert mixed.output_dtype == torch.float32


@pytest.mark.parametrize("layout", ["groups", "group"])
def test_the_fsdp2_policy_is_found_in_either_torch_layout(monkeypatch, layout):
    """torch 2.13 keeps an FSDP2 state's parameter groups in ``_fsdp_param_groups``; torch
    2.11 kept one in ``_fsdp_param_group``. Read only the first, a bfloat16 shard under
    torch 2.11 fell back to the process-wide float16 note and got dynamic scaling (seen on
    an H200 box with torch 2.11)."""
    import types
    import weakref

    from torch.distributed import _composable_state

    from mixprec import _dist

    shard = torch.zeros(2)
    group = types.SimpleNamespace(
        fsdp_params=[types.SimpleNamespace(sharded_param=shard)],
        mp_policy=types.SimpleNamespace(param_dtype=torch.bfloat16),
    )

    class State:  # weakref-able, as torch's FSDPState is
        pass

    state = State()
    setattr(
        state,
        "_fsdp_param_groups" if layout == "groups" else "_fsdp_param_group",
        [group] if layout == "groups" else group,
    )
    module = nn.Linear(2, 2)
    mapping = weakref.WeakKeyDictionary({module: weakref.ref(state)})
    monkeypatch.setattr(_composable_state, "_module_state_mapping", mapping)
    monkeypatch.setattr(_dist, "_FSDP_FLOAT16", [True])  # a float16 policy made elsewhere
    assert _dist.fsdp_compute_dtype([shard]) == torch.bfloat16
    assert not _dist.fsdp_computes_in_float16([shard])
    assert _dist.fsdp_compute_dtype([torch.zeros(2)]) is None  # not a shard of it


def test_shutdown_without_a_process_group_is_a_no_op():
    assert not torch.distributed.is_initialized()
    mpd.shutdown()  # must not raise (the CLI calls it on every exit)
    mpd.shutdown(wait=False)
    assert not torch.distributed.is_initialized()


def test_the_trainer_joins_torchrun_before_it_picks_its_gpu(monkeypatch):
    """init_from_env sets each rank's GPU; "auto" (or "cuda") resolved before it put every
    rank's model on GPU 0. Checked on CPU: the order of the calls, and "auto" naming the
    current GPU."""
    from mixprec import _device

    calls = []
    monkeypatch.setattr(mpd, "init_from_env", lambda: calls.append("init") or False)

    class Recorded(nn.Sequential):
        def to(self, *args, **kwargs):  # type: ignore[override]
            calls.append("to")
            return super().to(*args, **kwargs)

    model = Recorded(nn.Linear(4, 2))
    mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), 0.1), device="cpu")
    assert calls[:2] == ["init", "to"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert _device.resolve_device("auto") == torch.device("cuda", 1)
