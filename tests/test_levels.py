"""O0-O3: storage dtypes, compute dtypes, outputs, keep_float32, describe, bad input."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec as mp
import mixprec.policy
from mixprec import levels
from mixprec._hardware import Hardware
from mixprec.levels import Applied, applied, resolve_level
from tests.conftest import ROOT, TiedLM, make_mlp, make_transformer

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def storage(model):
    return {n: p.dtype for n, p in model.named_parameters()}


@pytest.mark.parametrize("compute", [BF16, F16])
def test_o2_storage(compute):
    model = mp.auto_mixed_precision(
        make_transformer(), policy=mp.Policy(compute_dtype=compute), level="O2"
    )
    s = storage(model)
    assert s["embed.weight"] == compute
    assert s["head.weight"] == compute
    assert s["encoder.layers.0.self_attn.in_proj_weight"] == compute
    assert s["encoder.layers.0.linear1.weight"] == compute
    assert s["encoder.layers.0.norm1.weight"] == F32  # normalisation stays float32
    assert s["norm.weight"] == F32
    assert s["pos"] == F32  # a bare parameter of a custom module: not matrix work
    out = model(torch.randint(0, 50, (3, 12)))
    assert out.dtype == F32  # mixed policies return float32


def test_o1_keeps_float32_weights_and_computes_16_bit():
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", level="O1")
    assert set(storage(model).values()) == {F32}
    inner = {}
    model[0].register_forward_hook(lambda m, a, o: inner.update(out=o.dtype))
    out = model(torch.randn(4, 32))
    assert inner["out"] == BF16 and out.dtype == F32


def test_o3_everything_16_bit_including_buffers():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    mp.auto_mixed_precision(model, "bfloat16", level="O3")
    assert set(storage(model).values()) == {BF16}
    assert model[1].running_mean.dtype == BF16
    assert model[1].num_batches_tracked.dtype == torch.int64  # integers never cast
    assert model(torch.randn(5, 4)).dtype == BF16  # the pure policy returns bfloat16


def test_o0_is_float32_even_for_mixed_policy():
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", level="O0")
    inner = {}
    model[0].register_forward_hook(lambda m, a, o: inner.update(out=o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # even inside a user's autocast
        model(torch.randn(2, 32))
    assert inner["out"] == F32


def test_keep_float32_by_type_name_and_module():
    model = make_transformer()
    mp.auto_mixed_precision(
        model,
        "mixed_bfloat16",
        level="O2",
        keep_float32=[nn.MultiheadAttention, "head", model.embed],
    )
    s = storage(model)
    assert s["head.weight"] == F32 and s["embed.weight"] == F32
    assert s["encoder.layers.1.self_attn.in_proj_weight"] == F32
    assert s["encoder.layers.1.self_attn.out_proj.weight"] == F32  # inside a kept module
    assert s["encoder.layers.1.linear2.weight"] == BF16


def test_keep_float32_pattern():
    model = mp.auto_mixed_precision(
        make_transformer(), "mixed_bfloat16", "O2", keep_float32=["encoder.layers.*.linear1"]
    )
    s = storage(model)
    assert s["encoder.layers.0.linear1.weight"] == F32
    assert s["encoder.layers.1.linear1.weight"] == F32
    assert s["encoder.layers.0.linear2.weight"] == BF16


def test_an_empty_keep_float32_entry_is_refused_not_the_whole_model():
    """ "" is the model's own name in named_modules(): an unset setting passed as
    keep_float32="" kept every layer in float32, without a word. "(model)" names it."""
    with pytest.raises(mp.ArgumentError, match=r"keep_float32 entry '' matches no module name"):
        mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2", keep_float32="")
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2", keep_float32="*")
    assert model[0].weight.dtype == F32  # every layer, by pattern
    whole = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2", keep_float32="(model)")
    assert whole[0].weight.dtype == F32


def test_to_float_before_auto_mixed_precision_is_kept():
    model = make_mlp()
    mp.to_float(model[5], torch.float32)
    mp.auto_mixed_precision(model, "mixed_float16", "O2")
    assert model[5].weight.dtype == F32 and model[0].weight.dtype == F16


def test_integer_inputs_untouched_and_masks_work():
    model = mp.auto_mixed_precision(make_transformer(), "mixed_bfloat16", "O2")
    seen = {}

    def spy(module, args, kwargs):
        seen["tokens"] = args[0]
        seen["mask"] = kwargs.get("pad_mask", args[1] if len(args) > 1 else None)

    model.register_forward_pre_hook(spy, with_kwargs=True)  # runs after mixprec's cast
    tokens = torch.randint(0, 50, (2, 12))
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[:, -2:] = True
    out = model(tokens, pad_mask=mask)
    assert seen["tokens"] is tokens and seen["mask"] is mask
    assert torch.isfinite(out).all()


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.bool]),
    level=st.sampled_from(["O1", "O2", "O3"]),
)
def test_any_integer_input_passes_through(dtype, level):
    class Echo(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x, ids):
            return self.lin(x), ids

    model = mp.auto_mixed_precision(Echo(), "mixed_float16", level)
    ids = torch.ones(4).to(dtype)
    out, ids_out = model(torch.randn(2, 3), ids)
    assert ids_out is ids
    assert out.dtype == F32  # mixed_float16 returns float32 at every level


def test_rnn_at_o2():
    model = nn.LSTM(4, 8, batch_first=True)
    mp.auto_mixed_precision(model, "mixed_bfloat16", "O2")
    assert model.weight_ih_l0.dtype == BF16
    out, (h, _) = model(torch.randn(2, 5, 4))
    assert out.dtype == F32 and h.dtype == F32


def test_auto_level_rule():
    assert resolve_level("auto", mp.Policy("float32")) == "O0"
    assert resolve_level("auto", mp.Policy("mixed_bfloat16")) == "O2"
    assert resolve_level("auto", mp.Policy("mixed_float16")) == "O2"
    assert resolve_level("auto", mp.Policy("bfloat16")) == "O3"
    assert resolve_level("o1", mp.Policy("float32")) == "O1"


def test_global_policy_is_the_default():
    mp.set_global_policy("mixed_bfloat16")
    model = mp.auto_mixed_precision(make_mlp())
    assert model[0].weight.dtype == BF16


def test_no_policy_anywhere_means_auto_and_says_so_once(monkeypatch):
    # As in a fresh process: set_global_policy never called (the fixture of conftest calls it).
    monkeypatch.setattr(mixprec.policy, "_GLOBAL", [levels._UNSET_GLOBAL])
    levels._say_auto.cache_clear()  # once per process: start afresh
    auto = mp.Policy("auto")
    with pytest.warns(UserWarning, match=r"no policy given and none set globally") as caught:
        model = mp.auto_mixed_precision(make_mlp())
    said = [str(w.message) for w in caught if "none set globally" in str(w.message)]
    assert len(said) == 1 and f"policy='auto' chose {auto.name} ({auto.reason})" in said[0]
    assert caught[0].filename == __file__  # points at the caller
    assert applied(model).policy == auto
    assert applied(model).level == resolve_level("auto", auto)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert applied(mp.auto_mixed_precision(make_mlp())).policy == auto  # said once
        # An explicit float32 stays float32 (O0), as a float32 global policy does.
        assert applied(mp.auto_mixed_precision(make_mlp(), "float32")).level == "O0"
        mp.set_global_policy("float32")
        assert applied(mp.auto_mixed_precision(make_mlp())).policy == mp.Policy("float32")


def test_a_fresh_process_prepares_with_auto_by_default():
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "import mixprec as mp\n"
        "from mixprec.levels import applied\n"
        "from tests.conftest import make_mlp\n"
        "print(applied(mp.auto_mixed_precision(make_mlp())).policy.name)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [mp.Policy("auto").name]
    assert "no policy given and none set globally: policy='auto' chose" in done.stderr


def test_the_tables_and_release_refuse_what_is_no_module():
    """describe(None), module_dtypes(None) and release_float32_copies(None) raised bare
    AttributeErrors."""
    for call, who in ((mp.describe, "describe"), (mp.module_dtypes, "module_dtypes"),
                      (mp.release_float32_copies, "release_float32_copies")):  # fmt: skip
        with pytest.raises(mp.ArgumentError, match=rf"{who}\(model=...\) needs an nn.Module, "
                           r"got NoneType"):  # fmt: skip
            call(None)


def test_describe_lists_every_module():
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2", keep_float32=["5"])
    text = mp.describe(model)
    lines = text.splitlines()
    assert lines[0] == "policy mixed_bfloat16, level O2"
    assert len(lines) == 3 + len(list(model.modules()))
    row = {line.split()[0]: line.split() for line in lines[3:]}
    assert row["0"][1:] == ["Linear", "bfloat16", "bfloat16"]
    # LayerNorm: 16-bit input, float32 weights and statistics (PyTorch's mixed kernel).
    assert row["3"][1:4] == ["LayerNorm", "bfloat16", "float32"]
    assert " ".join(row["3"][4:]) == (
        "output in its input's dtype (16-bit after a 16-bit layer); float32 weights and statistics"
    )
    assert row["5"][2:] == ["Linear", "float32", "float32"]
    assert row["1"][1:] == ["ReLU", "bfloat16", "-"]
    plain = mp.describe(make_mlp())
    assert "policy" not in plain.splitlines()[0]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"level": "O4"}, ValueError, r"level='O4' is not a known level; valid: O0, O1, O2, O3"),
        ({"level": 2}, TypeError, r"level=2 is invalid; valid: O0, O1, O2, O3, auto"),
        ({"policy": "mixed_bf16"}, ValueError, r"policy='mixed_bf16' is not a known policy"),
        ({"keep_float32": ["haed"]}, ValueError, r"'haed' matches no module.*closest: 'head'"),
        ({"keep_float32": [3]}, TypeError, r"keep_float32 entries must be .* got int: 3"),
        ({"keep_float32": [nn.Linear(2, 2)]}, ValueError, r"Linear module is not part of"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        mp.auto_mixed_precision(make_transformer(), **{"policy": "mixed_bfloat16", **kwargs})


def test_not_a_module_and_applied_twice():
    with pytest.raises(TypeError, match="needs a torch.nn.Module, got list"):
        mp.auto_mixed_precision([])  # type: ignore[arg-type]
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    with pytest.raises(RuntimeError, match=r"already applied .* \(level O2, policy mixed_bf"):
        mp.auto_mixed_precision(model, "mixed_float16", "O1")


def test_norm_layers_at_o2():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.GroupNorm(2, 4), nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    )  # fmt: skip
    mp.auto_mixed_precision(model, "mixed_bfloat16", "O2")
    assert model[1].weight.dtype == F32 and model[1].running_mean.dtype == F32
    seen = {}
    model[1].register_forward_hook(lambda m, a, o: seen.update(bn=o.dtype))
    model[2].register_forward_hook(lambda m, a, o: seen.update(gn=o.dtype))
    model(torch.randn(2, 1, 8, 8))
    # BatchNorm runs PyTorch's mixed kernel (bfloat16 in, float32 statistics); GroupNorm is a
    # float32 island that hands the next layer bfloat16 again.
    assert seen == {"bn": BF16, "gn": BF16}
    assert model[1].running_mean.abs().sum() > 0


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_sigmoid_module_computes_and_hands_on_float32(level):
    """A model ending in nn.Sigmoid (Keras' Dense(1, activation='sigmoid')) ran it in
    bfloat16: every probability above 0.998 came out exactly 1.0, and binary cross-entropy
    clamped a wrong one's loss at 100 with no gradient (4 noisy labels made 97% of the loss:
    0.2005 where float32 had 0.0059). It is a float32 module now, as nn.Softmax is."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
    x = torch.tensor([[1.0, 1.0, 2.0, 3.0]])  # logit 7: p = 0.99909, 1.0 in bfloat16
    expected = torch.sigmoid(torch.tensor(7.0))
    mp.auto_mixed_precision(model, "mixed_bfloat16", level)
    seen = {}
    model[1].register_forward_hook(lambda m, a, o: seen.update(dtype=o.dtype))
    p = model(x)
    assert seen == {"dtype": F32} and p.dtype == F32
    assert p.item() < 1.0 and p.item() == pytest.approx(expected.item(), abs=4e-3)
    y = torch.zeros(1, 1)  # the wrong label: a finite loss and a gradient back
    loss = nn.functional.binary_cross_entropy(p, y)
    assert loss.item() == pytest.approx(7.0, abs=0.3)
    loss.backward()
    assert model[0].bias.grad.float().abs().item() > 0.9  # sigmoid's p - y, not 0


def test_migrant_mistakes_get_clear_messages():
    with pytest.raises(ValueError, match=r"policy='O2' looks like a level.*level='O2'"):
        mp.auto_mixed_precision(make_mlp(), "O2")
    with pytest.warns(UserWarning, match=r"level=O2 with the float32 policy 'float32'"):
        mp.auto_mixed_precision(make_mlp(), level="O2")


@pytest.mark.parametrize("given", ["auto", mp.Policy, None])
def test_a_level_where_auto_picks_float32_says_why_not_to_pass_a_slow_policy(monkeypatch, given):
    # Portable code (policy="auto", level="O2") on a CPU without fast bfloat16: auto picks
    # float32 on purpose, as bfloat16 matmuls are emulated there. The warning advised
    # passing policy='mixed_bfloat16', the slow policy auto had just ruled out.
    cpu = Hardware("cpu", False, False, "CPU without AVX512-BF16 or AMX")
    monkeypatch.setattr(mixprec.policy, "probe_hardware", lambda: cpu)
    if given is None:  # the global policy set to auto keeps its reason
        mp.set_global_policy("auto")
    policy = mp.Policy("auto") if given is mp.Policy else given
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = mp.auto_mixed_precision(make_mlp(), policy, level="O2")
    said = [str(w.message) for w in caught if "changes nothing" in str(w.message)]
    assert said == [
        "level=O2 changes nothing here: policy='auto' picks float32 on this machine (CPU "
        "without AVX512-BF16 or AMX: no fast 16-bit matrix units; float32 is fastest), so the "
        "model stays float32; where auto picks a mixed policy, O2 applies"
    ]
    assert [w.filename for w in caught] == [__file__]
    assert applied(model).policy.name == "float32" and model[0].weight.dtype == F32


def test_o2_float16_embeddings_hand_on_float32():
    """Attention masks built in the residual stream's dtype must not be float16."""
    model = mp.auto_mixed_precision(make_transformer(), "mixed_float16", "O2")
    assert model.embed.weight.dtype == F16
    seen = {}
    model.embed.register_forward_hook(lambda m, a, o: seen.update(out=o.dtype))
    model(torch.randint(0, 50, (2, 12)))
    assert seen["out"] == F32
    bf = mp.auto_mixed_precision(make_transformer(), "mixed_bfloat16", "O2")
    bf.embed.register_forward_hook(lambda m, a, o: seen.update(bf=o.dtype))
    bf(torch.randint(0, 50, (2, 12)))
    assert seen["bf"] == BF16  # bfloat16 has float32's range: no reason to widen


def test_sparse_tables_stay_float32_under_float16():
    """PyTorch cannot add float16 sparse gradients on the CPU."""
    model = mp.auto_mixed_precision(mp.models.Recommender(sparse=True), "mixed_float16", "O2")
    assert model.tables[0].weight.dtype == F32
    opt = mp.LossScaleOptimizer(torch.optim.SparseAdam(list(model.tables.parameters())),
                                accumulation_steps=2)  # fmt: skip
    ids = torch.randint(0, 100, (8, 3))
    for _ in range(2):  # accumulation adds the sparse gradients of two backwards
        opt.backward(model(ids).float().pow(2).mean())
        opt.step()
    dense = mp.auto_mixed_precision(mp.models.Recommender(sparse=False), "mixed_float16", "O2")
    assert dense.tables[0].weight.dtype == F16


class _Matmul(nn.Module):
    """A custom module (not a known type) to keep in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


# kept module, its input, and the normalisations that can follow it
_KEPT = {
    "linear": (lambda: nn.Linear(8, 8), lambda: torch.randn(6, 8), ("bn1d", "ln", "gn")),
    "embedding": (lambda: nn.Embedding(10, 8), lambda: torch.randint(0, 10, (6,)),
                  ("bn1d", "ln", "gn")),
    "custom": (_Matmul, lambda: torch.randn(6, 8), ("bn1d", "ln", "gn")),
    "conv1d": (lambda: nn.Conv1d(8, 8, 1), lambda: torch.randn(6, 8, 5), ("bn1d", "gn")),
    "conv2d": (lambda: nn.Conv2d(8, 8, 1), lambda: torch.randn(6, 8, 3, 3), ("bn2d", "gn")),
}  # fmt: skip
_NORMS = {
    "bn1d": lambda: nn.BatchNorm1d(8),
    "bn2d": lambda: nn.BatchNorm2d(8),
    "ln": lambda: nn.LayerNorm(8),
    "gn": lambda: nn.GroupNorm(2, 8),
}
# Max |mixed - float32| over the whole matrix, measured: float16 2.2e-3, bfloat16 1.8e-2
# (normalised outputs of unit scale; bfloat16 has 3 fewer mantissa bits). Bounds ~4x.
_KEPT_TOLERANCE = {"mixed_float16": 1e-2, "mixed_bfloat16": 7e-2}


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("how", ["keep_float32", "to_float after"])
def test_a_kept_float32_module_feeds_every_normalisation(level, policy, how):
    """Issue 20: at O3 a Conv kept in float32 followed by BatchNorm raised "mixed dtype
    (CPU)". Every kept type, followed by every normalisation, at every level, in training
    and evaluation, gives float32 outputs close to the float32 model's."""
    for kind, (make, inputs, norms) in _KEPT.items():
        for norm in norms:
            torch.manual_seed(0)
            model = nn.Sequential(make(), _NORMS[norm]())
            control = copy.deepcopy(model)
            if how == "keep_float32":
                mp.auto_mixed_precision(model, policy, level, keep_float32=["0"])
            else:
                mp.auto_mixed_precision(model, policy, level)
                mp.to_float(model[0], "float32")
            for training in (True, False):
                model.train(training)
                control.train(training)
                x = inputs()
                out = model(x)
                assert out.dtype == torch.float32, (kind, norm, training)
                err = (out - control(x)).abs().max().item()
                assert err < _KEPT_TOLERANCE[policy], (kind, norm, training, err)


# -- MindSpore's O3 (amp_level="O3"): 16-bit compute everywhere, float32 masters -----------


def _ms_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 4)
    )


def _unchanged_after_small_sgd(**prepare: Any) -> float:
    """Fraction of weights an 8-step SGD run at lr 1e-4 leaves bit-identical (issue 20's
    measurement: MindSpore 2.10's O3 leaves 0.2%, mixprec's O3 86%)."""
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(_ms_net(), "mixed_float16", **prepare)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4))
    before = [p.detach().float().clone() for p in opt.master_params()]
    x, y = torch.randn(32, 64), torch.randint(0, 4, (32,))
    for _ in range(8):
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x), y))
        assert opt.step().applied
    same = sum(
        (a == b.float()).sum().item() for a, b in zip(before, opt.master_params(), strict=True)
    )
    return same / sum(a.numel() for a in before)


def test_mindspore_o3_keeps_small_updates_that_mixprec_o3_loses() -> None:
    # Measured: 0.92 unchanged at level="O3", 0.013 at amp_level="O3" (dead-ReLU rows).
    assert _unchanged_after_small_sgd(level="O3") > 0.5
    assert _unchanged_after_small_sgd(amp_level="O3") < 0.05


def test_mindspore_o3_computes_everything_in_16_bit_with_float32_masters() -> None:
    net = _ms_net()
    original = [p.detach().clone() for p in net.parameters()]
    model = mp.auto_mixed_precision(net, amp_level="O3")  # MindSpore's default float16
    assert applied(model) == Applied(mp.Policy("mixed_float16"), "O3", (), o3_masters=True)
    # Normalisation included, unlike mixprec's O2 (and MindSpore's O2).
    assert {r.compute for r in mp.module_dtypes(model)} == {"float16"}
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert model[1].running_var.dtype == torch.float16
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    masters = [m for _, m in opt.master_weights()]
    assert len(masters) == len(list(model.parameters()))
    assert all(m.dtype == torch.float32 for m in masters)
    # The masters start from the float32 values, not the rounded 16-bit ones.
    for master, value in zip(masters, original, strict=True):
        assert torch.equal(master, value)
    assert "MindSpore's: float32 master weights" in mp.describe(model)


def test_mindspore_o3_tracks_float32() -> None:
    losses = {}
    for name, kwargs in {"fp32": {"amp_level": "O0"}, "o3": {"amp_level": "O3"}}.items():
        torch.manual_seed(0)
        model = mp.auto_mixed_precision(_ms_net(), "mixed_bfloat16", **kwargs)
        opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(64, 64, generator=gen)
        y = (x[:, :4].argmax(1)).long()
        for _ in range(30):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            opt.backward(loss)
            opt.step()
        losses[name] = loss.item()
    # bfloat16 everywhere (8-bit mantissa) against float32: measured 1-2% apart after 30 steps.
    assert losses["o3"] == pytest.approx(losses["fp32"], rel=0.05)
    assert losses["o3"] < 1.2  # it learned (ln 4 = 1.39 at the start)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"level": "O2", "amp_level": "O3"}, r"takes level= \(mixprec's\) or amp_level="),
        ({"amp_level": "O4"}, r"amp_level='O4' is invalid; valid: O0, O1, O2, O3"),
        ({"amp_level": "auto"}, r"amp_level='auto' is invalid"),
        ({"amp_level": 3}, r"amp_level=3 is invalid"),
    ],
)
def test_amp_level_bad_input(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mp.auto_mixed_precision(_ms_net(), **kwargs)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_describe_says_what_16_bit_batch_and_layer_norm_keep(level: str) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.LayerNorm(8), nn.GroupNorm(2, 8))
    model = mp.auto_mixed_precision(model, "mixed_float16", level)
    seen = []
    for norm in model[1:3]:
        norm.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    model(torch.randn(4, 8))
    assert seen == [(torch.float16, torch.float16)] * 2  # what the note claims
    rows = {r.name: r for r in mp.module_dtypes(model)}
    for name in ("1", "2"):
        assert (rows[name].compute, rows[name].storage) == ("float16", "float32")
        assert rows[name].note.startswith("output in its input's dtype (16-bit after")
    assert rows["3"].note == ""  # GroupNorm is a float32 island: its compute says so
    assert "note" in mp.describe(model).splitlines()[1]


def test_describe_does_not_say_16_bit_in_for_a_norm_given_float32() -> None:
    """A LayerNorm first in an O1 model gets the float32 input as given and hands float32
    on; its note said "16-bit in and out"."""
    model = mp.auto_mixed_precision(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4)),
                                    "mixed_bfloat16", "O1")  # fmt: skip
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    model(torch.randn(2, 8))
    assert seen == [(torch.float32, torch.float32)]
    note = {r.name: r.note for r in mp.module_dtypes(model)}["0"]
    assert note.startswith("output in its input's dtype") and "16-bit in and out" not in note


def test_describe_has_no_note_column_when_no_row_needs_one() -> None:
    model = mp.auto_mixed_precision(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), "bfloat16")
    assert "note" not in mp.describe(model)


def test_values_past_float16s_range_are_refused_before_anything_changes():
    # Stored in float16 they became inf: a bias of 1e5, or O3's BatchNorm statistics of raw
    # features (running_var ~1e6), turned the outputs to inf or to one constant.
    big = nn.Sequential(nn.Linear(4, 2), nn.ReLU(), nn.Linear(2, 2))
    with torch.no_grad():
        big[0].bias.fill_(1e5)
    with pytest.raises(mp.ArgumentError, match=r"'0.bias' has max \|value\| 100000, beyond "
                       r"float16's 65504.*keep_float32=\['0'\]"):  # fmt: skip
        mp.auto_mixed_precision(big, "mixed_float16", "O2")
    assert big[0].weight.dtype == torch.float32 and mp.levels.applied(big) is None
    kept = mp.auto_mixed_precision(big, "mixed_float16", "O2", keep_float32=["0"])
    assert kept[0].bias.dtype == torch.float32 and kept[2].weight.dtype == torch.float16
    norm = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    norm[1].running_var.fill_(1e6)
    with pytest.raises(mp.ArgumentError, match=r"'1.running_var' has max \|value\| 1e\+06"):
        mp.auto_mixed_precision(norm, "mixed_float16", "O3")
    # bfloat16 has float32's range; O2 stores no buffers.
    mp.auto_mixed_precision(copy.deepcopy(norm), "mixed_bfloat16", "O3")
    mp.auto_mixed_precision(norm, "mixed_float16", "O2")
    # A model built on the meta device (deferred init) has no values to look at.
    with torch.device("meta"):
        deferred = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert mp.auto_mixed_precision(deferred, "mixed_float16", "O3")[0].weight.is_meta


def test_a_model_with_a_prepared_part_or_inside_a_prepared_one_is_refused():
    # The submodule of a prepared model was prepared again under another policy (float16
    # regions inside a bfloat16 model), and a parent of a prepared submodule left its O2
    # weights in float32, said by a generic upcast warning alone.
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    mp.auto_mixed_precision(model, "mixed_bfloat16", "O2")
    with pytest.raises(RuntimeError, match="its parameters belong to a model prepared already"):
        mp.auto_mixed_precision(model[1], "mixed_float16", "O2")
    parent = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    mp.auto_mixed_precision(parent[1], "mixed_bfloat16", "O2")
    with pytest.raises(RuntimeError, match=r"its module '1' was prepared already"):
        mp.auto_mixed_precision(parent, "mixed_bfloat16", "O2")


def test_amp_level_takes_a_global_policy_that_was_set():
    """set_global_policy('mixed_bfloat16') then amp_level='O2' trained in float16 with a
    dynamic loss scale, the policy set ignored, where level='O2' gave bfloat16."""
    with mp.policy_scope("mixed_bfloat16"):
        model = mp.auto_mixed_precision(nn.Sequential(nn.Linear(4, 4)), amp_level="O2")
    assert model[0].weight.dtype == BF16
    plain = mp.auto_mixed_precision(nn.Sequential(nn.Linear(4, 4)), amp_level="O2")
    assert plain[0].weight.dtype == torch.float16  # none set: MindSpore's default dtype


@pytest.mark.parametrize(("policy", "level"), [("mixed_bfloat16", "O2"), ("bfloat16", "O3")])
def test_a_submodule_called_alone_takes_a_region_of_its_own(policy, level):
    """docs/troubleshooting.md: a submodule of an O2/O3 model called with float32 inputs
    meets its 16-bit weights outside the model's region (torch's dtype error); with
    ``to_float`` at the compute dtype it runs, and the whole model is unchanged."""
    model = mp.auto_mixed_precision(
        nn.Sequential(
            nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU()), nn.Linear(32, 4)
        ),
        policy,
        level,
    )
    x = torch.randn(4, 16)
    whole = model(x)
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        model[0](x)
    mp.to_float(model[0], torch.bfloat16)
    assert model[0](x).dtype == torch.bfloat16
    assert torch.equal(model(x), whole)


class _Rotary(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        freqs = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("inv_freq", freqs, persistent=False)

    def forward(self, x, pos):
        f = pos.float()[:, None] * self.inv_freq.float()[None]
        emb = torch.cat([f, f], -1)
        return x * emb.cos() + x.roll(1, -1) * emb.sin()


class _Rotated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(64, 64)
        self.rotary_emb = _Rotary()

    def forward(self, x, pos):
        return self.rotary_emb(self.q(x), pos)


def test_o3_rotary_frequencies_kept_float32_as_the_docs_say():
    """docs/policies-and-levels.md: a rotary ``inv_freq`` in bfloat16 is 13% off at 2048
    positions; its module kept in float32, 0.3% (the bfloat16 Linear)."""
    torch.manual_seed(0)
    base, x, pos = _Rotated(), torch.randn(2048, 64), torch.arange(2048)
    control = base(x, pos)

    def off(keep):
        model = mp.auto_mixed_precision(copy.deepcopy(base), "bfloat16", "O3", keep_float32=keep)
        out = model(x, pos).float()
        return (out - control).norm().item() / control.norm().item()

    assert off(["rotary_emb"]) < 1e-2 < 5e-2 < off([])


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(100, 16, mode="sum")
        self.gate = nn.Linear(16, 1)

    def forward(self, idx, offsets, feats):
        weights = torch.sigmoid(self.gate(feats)).squeeze(-1)  # in the compute dtype
        return self.bag(idx, offsets, per_sample_weights=weights)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_embedding_bag_takes_per_sample_weights_computed_in_the_model(policy, level):
    """CPU autocast does not cover embedding_bag: weights computed in 16 bits met a float32
    table (O1) in torch's raw "same type" error."""
    torch.manual_seed(0)
    control = _Bag()
    idx, offsets = torch.randint(0, 100, (40,)), torch.tensor([0, 10, 20, 30])
    feats = torch.randn(40, 16)
    model = mp.auto_mixed_precision(copy.deepcopy(control), policy, level)
    out = model(idx, offsets, feats).float()
    torch.testing.assert_close(out, control(idx, offsets, feats), rtol=2e-2, atol=2e-2)


def test_a_hugging_face_models_own_float32_modules_are_kept():
    """T5 declares _keep_in_fp32_modules = {"wo"} (its float16 output overflows) and HF's
    own float16 loading keeps it float32; prepared by mixprec it computed and was stored in
    float16, unsaid. _keep_in_fp32_modules_strict holds under bfloat16 too."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wi, self.wo = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.wo(torch.relu(self.wi(x)))

    class T5Like(nn.Module):
        _keep_in_fp32_modules = frozenset({"wo"})
        _keep_in_fp32_modules_strict = frozenset({"gate", "word.bias"})  # a module, a tensor

        def __init__(self) -> None:
            super().__init__()
            self.block = nn.ModuleList([Block(), Block()])
            self.gate, self.word = nn.Linear(8, 8), nn.Linear(8, 8)  # "word" is not "wo"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.block:
                x = block(x)
            return self.word(self.gate(x))

    dtypes = {}
    for policy in ("mixed_float16", "mixed_bfloat16"):
        model = mp.auto_mixed_precision(T5Like(), policy, "O2")
        model(torch.randn(2, 8)).sum().backward()
        dtypes[policy] = {n: p.dtype for n, p in model.named_parameters() if n.endswith("weight")}
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    assert dtypes["mixed_float16"] == {
        "block.0.wi.weight": f16, "block.0.wo.weight": f32, "block.1.wi.weight": f16,
        "block.1.wo.weight": f32, "gate.weight": f32, "word.weight": f32,
    }  # fmt: skip
    assert dtypes["mixed_bfloat16"]["block.0.wo.weight"] == bf16  # not strict: HF's too
    assert dtypes["mixed_bfloat16"]["gate.weight"] == f32
    # Asked again with the same keep_float32 (a second MixprecTrainer): as prepared, not a
    # refusal naming the declared modules as another keep_float32.
    from mixprec._prepare_once import needs_preparation

    model = mp.auto_mixed_precision(T5Like(), "mixed_float16", "O2", keep_float32=["word"])
    assert not needs_preparation(model, "mixed_float16", "O2", where="test",
                                 keep_float32=["word"])  # fmt: skip


def test_describe_counts_a_parametrized_weight_in_its_modules_row():
    """weight_norm's weight lives in a ParametrizationList child, which O2 leaves float32:
    describe said "bfloat16" for the Linear (its bias alone), unsaid."""
    from torch.nn.utils.parametrizations import weight_norm

    model = nn.Sequential(weight_norm(nn.Linear(64, 64)), nn.ReLU(), nn.Linear(64, 10))
    model = mp.auto_mixed_precision(model, "mixed_bfloat16", "O2")
    rows = {r.name: r for r in mp.dtype_table.module_dtypes(model)}
    assert rows["0"].storage == "bfloat16,float32"  # the bias, and the weight's g and v
    assert model[0].parametrizations.weight.original0.dtype == torch.float32
    assert rows["2"].storage == "bfloat16"


def test_a_parametrization_registered_after_preparation_is_said_at_the_optimizer():
    """weight_norm registered on a prepared O2 Linear: torch computed g and v from the
    bfloat16 weight, as new bfloat16 parameters, and their masters started from them
    (g 2.3e-3 off a float32 control's), unsaid. Registered before, they stay float32."""
    import torch.nn.utils.parametrize as parametrize
    from torch.nn.utils.parametrizations import weight_norm

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    control = weight_norm(net()[0]).parametrizations.weight.original0.detach()
    model = mp.auto_mixed_precision(net(), "mixed_bfloat16", "O2")
    weight_norm(model[0])
    with pytest.warns(UserWarning, match=r"0\.parametrizations\.weight\.original0, "
                      r"0\.parametrizations\.weight\.original1: a parametrization registered "
                      r"after auto_mixed_precision .* before preparing") as seen:  # fmt: skip
        opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), 1e-5))
    assert [w.filename for w in seen] == [__file__]
    g = next(m for p, m in opt.master_weights() if p is model[0].parametrizations.weight.original0)
    assert (g - control).abs().max() > 1e-3  # what it says: the roundings' values

    class Scale(nn.Module):  # no right_inverse: the original is the prepared weight itself
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 2 * w

    same = mp.auto_mixed_precision(net(), "mixed_bfloat16", "O2")
    parametrize.register_parametrization(same[0], "weight", Scale())
    before = mp.auto_mixed_precision(nn.Sequential(weight_norm(nn.Linear(16, 4))),
                                     "mixed_bfloat16", "O2")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.LossScaleOptimizer(torch.optim.AdamW(same.parameters(), 1e-5))
        mp.LossScaleOptimizer(torch.optim.AdamW(before.parameters(), 1e-5))


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_o2_keeps_a_layer_under_torchs_old_spectral_norm_in_float32(policy: str) -> None:
    """``nn.utils.spectral_norm`` (the hook, not the parametrization) iterates with float32
    buffers against ``weight_orig``: stored in 16 bits at O2, every forward failed."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.utils.spectral_norm(nn.Linear(16, 16)), nn.ReLU(), nn.Linear(16, 4))

    x = torch.randn(8, 16)
    control = model()
    prepared = mp.auto_mixed_precision(model(), policy, "O2")
    assert prepared[0].weight_orig.dtype == torch.float32
    assert prepared[2].weight.dtype != torch.float32  # the rest is O2 as before
    out = prepared(x).float()
    assert torch.allclose(out, control(x), rtol=0.05, atol=0.02)  # 16-bit matmuls


def test_a_shared_module_is_kept_in_float32_by_any_of_its_names() -> None:
    """``keep_float32`` read the model's names without repeats: a block used twice could
    not be named by its second name, which ``describe`` lists ("matches no module")."""
    block = nn.Linear(8, 8)
    model = nn.Sequential(nn.ModuleList([block, block]), nn.Linear(8, 2))
    model.enc = block  # type: ignore[assignment]
    assert "enc" in {r.name for r in mp.module_dtypes(model)}
    for name in ("enc", "0.1"):
        prepared = mp.auto_mixed_precision(copy.deepcopy(model), "mixed_bfloat16", "O2",
                                           keep_float32=[name])  # fmt: skip
        assert prepared.enc.weight.dtype == torch.float32 and prepared.enc is prepared[0][1]
        assert prepared[1].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_to_float_before_preparing_keeps_a_tied_weight_float32(level: str) -> None:
    """``mp.to_float(head, "float32")`` before ``auto_mixed_precision`` on a head tied to
    the embedding: the embedding stored the shared weight in 16 bits, and every forward
    failed ("expected m1 and m2 to have the same dtype"). As with keep_float32 now."""
    model = TiedLM()
    mp.to_float(model.head, "float32")
    mp.auto_mixed_precision(model, "mixed_bfloat16", level)
    assert model.head.weight.dtype == torch.float32
    assert model(torch.randint(0, 50, (2, 3))).dtype == torch.float32


def test_o1_runs_a_bilinear_layer_after_a_16_bit_one_in_float32() -> None:
    """Autocast casts no ``bilinear``: after a 16-bit Linear its bfloat16 inputs met its
    float32 weights ("All tensors must have the same dtype"), as under plain autocast,
    and ``describe`` said it computed in bfloat16."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bil = nn.Linear(8, 8), nn.Bilinear(8, 8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return self.bil(h, h)

    torch.manual_seed(0)
    control = Net()
    model = mp.auto_mixed_precision(copy.deepcopy(control), "mixed_bfloat16", "O1")
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x).float(), control(x), atol=0.05, rtol=0.05)
    rows = {r.name: r.compute for r in mp.module_dtypes(model)}
    assert rows["bil"] == "float32" and rows["lin"] == "bfloat16"
