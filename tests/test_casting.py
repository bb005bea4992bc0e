"""Cast rules: only floating tensors are cast; regions; to_float; float32 islands."""

from __future__ import annotations

import copy
from collections import namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec as mp
from mixprec._float32_copies import remember_float32
from mixprec.casting import Float32Functions, cast_floating, upcast_16bit
from mixprec.region import get_region, needs_float32_functions

ALL_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    torch.complex64,
]  # fmt: skip

Pair = namedtuple("Pair", "a b")


@settings(max_examples=60, deadline=None)
@given(
    dtypes=st.lists(st.sampled_from(ALL_DTYPES), min_size=1, max_size=5),
    target=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    extra=st.one_of(st.none(), st.integers(), st.text(max_size=3), st.floats(allow_nan=False)),
)
def test_only_floating_tensors_are_cast(dtypes, target, extra):
    tensors = [torch.ones(2).to(d) for d in dtypes]
    tree = {"list": list(tensors), "tuple": tuple(tensors), "pair": Pair(tensors[0], extra)}
    out = cast_floating(tree, target)
    for original, cast in zip(tensors, out["list"], strict=True):
        if original.is_floating_point():
            assert cast.dtype == target
        else:
            assert cast is original  # integer, bool and complex: the very same object
    assert isinstance(out["pair"], Pair) and out["pair"].b == extra
    assert isinstance(out["tuple"], tuple)


def test_cast_floating_takes_a_dtype_name_and_refuses_a_non_floating_dtype():
    """ "float16" raised "Invalid device string"; torch.int8 truncated every float."""
    x = torch.tensor([1.7, -2.5])
    assert cast_floating({"a": x}, "bf16")["a"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"dtype=torch.int8 is invalid; a floating dtype"):
        cast_floating(x, torch.int8)
    with pytest.raises(ValueError, match=r"dtype='half16' is not a known dtype"):
        cast_floating(x, "half16")
    assert cast_floating(x.double(), torch.float64).dtype == torch.float64  # kept working


def test_region_casts_inputs_outputs_and_never_integers():
    seen = {}

    class Probe(nn.Module):
        def forward(self, x, ids, mask=None, scale=2.0):
            seen.update(x=x.dtype, ids=ids.dtype, mask=mask.dtype, scale=scale)
            return {"y": x * scale, "ids": ids}

    m = mp.to_float(Probe(), "bf16")
    ids = torch.tensor([1, 2])
    out = m(torch.ones(2), ids, mask=torch.tensor([True, False]), scale=3.0)
    assert seen == {"x": torch.bfloat16, "ids": torch.int64, "mask": torch.bool, "scale": 3.0}
    assert out["y"].dtype == torch.bfloat16 and out["ids"] is ids


def test_to_float_float32_restores_storage_and_disables_autocast():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    original = model[1].weight.detach().clone()
    mp.auto_mixed_precision(model, "mixed_bfloat16", level="O2")
    assert model[1].weight.dtype == torch.bfloat16
    mp.to_float(model[1], torch.float32)
    assert model[1].weight.dtype == torch.float32
    assert torch.equal(model[1].weight, original)  # the float32 values, not rounded ones
    captured = {}
    model[1].register_forward_hook(lambda m, a, o: captured.update(out=o.dtype))
    model(torch.randn(3, 4))
    assert captured["out"] == torch.float32  # autocast is off inside the float32 module


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag, self.lin = nn.EmbeddingBag(50, 8, mode="sum"), nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.lin(self.bag(ids, per_sample_weights=weights))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 4)
    )


@pytest.mark.parametrize(
    "make, policy, level, inputs",
    [
        (_cnn, "bfloat16", "O3", lambda: (torch.randn(2, 3, 8, 8),)),
        (_Bag, "mixed_bfloat16", "O2", lambda: (torch.randint(0, 50, (2, 5)), torch.rand(2, 5))),
    ],
    ids=["O3 BatchNorm", "O2 EmbeddingBag"],
)
def test_to_float_float32_runs_the_regions_inside_in_float32_too(make, policy, level, inputs):
    """The 16-bit regions the level put inside (O3's norms, O2's EmbeddingBag) stayed: they
    cast on to 16 bits what then met float32 weights, and the forward failed on dtypes."""
    torch.manual_seed(0)
    control = make()
    model = mp.auto_mixed_precision(copy.deepcopy(control), policy, level)
    args = inputs()
    model(*args)
    mp.to_float(model, torch.float32)
    assert {r.compute for r in mp.module_dtypes(model)} == {"float32"}
    if level == "O3":  # keeps no float32 values: the weights come back as their roundings
        with torch.no_grad():
            for p in control.parameters():
                p.copy_(p.to(torch.bfloat16))
    # Exactly the float32 model's forward (train mode: BatchNorm's batch statistics).
    torch.testing.assert_close(model(*args), control(*args), rtol=0, atol=0)


class _LossInside(nn.Module):
    """A Hugging Face style forward: the loss computed inside, in float32, and a float64
    statistic kept wide on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits.float(), labels)
        self.inside = loss.detach().clone()
        wide = logits.double().exp().sum(-1) * 1e300  # past float32's range
        return {"loss": loss, "logits": logits, "wide": wide}


@pytest.mark.parametrize(
    ("policy", "level"), [("bfloat16", "O3"), ("mixed_bfloat16", "O1"), ("mixed_float16", "O2")]
)
def test_outputs_the_forward_made_wide_leave_as_they_are(policy, level):
    """The output cast rounded a float32 loss computed inside forward to bfloat16 at O3
    (1.3855 returned as 1.3828) and narrowed a float64 result to float32 (here inf): a
    float64 output, and a float32 scalar where outputs leave in 16 bits, stay; the rest
    leave in the policy's output dtype."""
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(_LossInside(), policy, level)
    out = model(torch.randn(8, 16), torch.randint(0, 4, (8,)))
    assert out["loss"].dtype == torch.float32 and torch.equal(out["loss"], model.inside)
    assert out["wide"].dtype == torch.float64 and torch.isfinite(out["wide"]).all()
    assert out["logits"].dtype == (torch.bfloat16 if level == "O3" else torch.float32)


class _InfoNCE(nn.Module):
    """A contrastive loss written by hand inside forward: exp(similarity / 0.07), a sum and
    a log, as CUDA's autocast runs them in float32 (and CPU autocast does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(16, 32)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        za, zb = nn.functional.normalize(self.enc(a), dim=-1), self.enc(b)
        zb = zb / zb.pow(2).sum(-1, keepdim=True).rsqrt().reciprocal()
        sim = torch.exp(za @ zb.T / 0.07)
        self.dtypes = {sim.dtype, za.dtype, zb.dtype}
        return -torch.log(sim.diagonal() / sim.sum(-1)).mean()


@pytest.mark.parametrize(("policy", "level"), [("mixed_float16", "O2"), ("mixed_bfloat16", "O1"),
                                               ("bfloat16", "O3")])  # fmt: skip
def test_hand_written_math_runs_in_float32_and_float16s_results_stay_float32(policy, level):
    """exp(14.3) is inf in float16: the loss was NaN from the first step and every step
    skipped. exp, log, pow, sum, rsqrt, reciprocal and normalize now run in float32; for
    float16 they return float32, as CUDA's autocast does; bfloat16 (float32's range) is
    rounded back once, so what follows keeps its dtype."""
    torch.manual_seed(0)
    control = _InfoNCE()
    a, b = torch.randn(64, 16), torch.randn(64, 16)
    model = mp.auto_mixed_precision(copy.deepcopy(control), policy, level)
    loss = model(a, b)
    kept = torch.float32 if policy == "mixed_float16" else torch.bfloat16
    assert model.dtypes == {kept} and torch.isfinite(loss)
    expected = control(a, b)
    tolerance = 2e-3 if policy == "mixed_float16" else 2e-2  # the encoder's 16-bit matmul
    torch.testing.assert_close(loss.float(), expected, rtol=tolerance, atol=0)
    loss.backward()
    expected.backward()
    for p, q in zip(model.parameters(), control.parameters(), strict=True):
        assert torch.isfinite(p.grad).all()
        torch.testing.assert_close(p.grad.float(), q.grad, rtol=0, atol=0.1 * q.grad.abs().max())


class _Operators(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h**2 + 1 / (h.abs() + 1) + 2 ** h.clamp(-3, 3) + x**2


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_operators_run_in_float32_and_compile_whole(level):
    """x ** 2, 2 ** x and 1 / x, compared by identity: as members of a set, dynamo's guard
    on them failed on the frame that made it, and torch.compile of the model raised."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    policy = "bfloat16" if level == "O3" else "mixed_float16"
    model = mp.auto_mixed_precision(_Operators(), policy, level)
    x = torch.randn(4, 16)
    eager = model(x)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    compiled = torch.compile(model, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    if policy == "mixed_float16":  # ** of a float16 activation: float32, as on CUDA
        with mp.casting.Float32Functions():
            h = torch.randn(3, dtype=torch.float16)
            assert (h**2).dtype == (1 / h).dtype == (2**h).dtype == torch.float32


def test_to_float_errors():
    with pytest.raises(TypeError, match="needs a torch.nn.Module, got str"):
        mp.to_float("layer", torch.float32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"to_float dtype='int8' is not a known dtype"):
        mp.to_float(nn.Linear(2, 2), "int8")


def test_region_context_is_closed_when_forward_raises():
    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    m = mp.to_float(Boom(), torch.bfloat16)
    with pytest.raises(ValueError, match="boom"):
        m(torch.ones(2))
    assert not torch.is_autocast_enabled("cpu")
    assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_float32_functions_run_in_float32_under_cpu_autocast():
    torch.manual_seed(0)
    x = torch.randn(64, 256) * 4
    y = torch.randint(0, 256, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = nn.functional.linear(x, torch.randn(256, 256))
        assert h.dtype == torch.bfloat16
        plain = h.log_softmax(-1)  # CPU autocast alone: computed in bfloat16
        with Float32Functions():
            soft = nn.functional.softmax(h, -1)
            logsoft = h.log_softmax(-1)
            normed = nn.functional.layer_norm(h, (256,))
            loss = nn.functional.cross_entropy(h, y)
            assert (h @ h.T).dtype == torch.bfloat16  # matmuls are untouched
    wide = h.float()
    # Computed in float32, returned in the input's dtype (rounded once at the end)...
    assert torch.equal(soft, nn.functional.softmax(wide, -1).to(torch.bfloat16))
    assert torch.equal(logsoft, wide.log_softmax(-1).to(torch.bfloat16))
    assert torch.equal(normed, nn.functional.layer_norm(wide, (256,)).to(torch.bfloat16))
    assert not torch.equal(plain, logsoft)  # ...which the bfloat16 computation is not
    # ...and losses stay float32.
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, nn.functional.cross_entropy(wide, y))


class _CustomSoftmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.softmax(x, -1)


def test_regions_of_plain_modules_skip_the_float32_functions_mode():
    plain = nn.Sequential(nn.Flatten(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    island = nn.Sequential(nn.Linear(8, 8), nn.Softmax(-1))  # Softmax: a float32 region
    custom = nn.Sequential(nn.Linear(8, 8), _CustomSoftmax())  # may call anything
    for model in (plain, island, custom):
        mp.auto_mixed_precision(model, "mixed_bfloat16", "O1")
    assert not needs_float32_functions(plain)
    assert not needs_float32_functions(island)
    assert needs_float32_functions(custom)
    assert needs_float32_functions(nn.Sequential(nn.Linear(8, 8), nn.Softmax(-1)))  # no island
    # Where the mode is kept, the custom softmax still runs in float32 under CPU autocast.
    torch.manual_seed(0)
    x = torch.randn(16, 8) * 8
    h = nn.functional.linear(x.bfloat16(), custom[0].weight.bfloat16(), custom[0].bias.bfloat16())
    expected = nn.functional.softmax(h.float(), -1).to(torch.bfloat16).float()
    assert torch.equal(custom(x), expected)


def test_float32_function_output_feeds_a_16_bit_batchnorm_at_o3():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Softmax(-1), nn.BatchNorm1d(8))
    mp.auto_mixed_precision(model, "bfloat16", "O3")
    assert model(torch.randn(4, 8)).dtype == torch.bfloat16


def test_output_containers_keep_their_types():
    from collections import OrderedDict
    from dataclasses import dataclass, field

    @dataclass
    class Out:
        logits: torch.Tensor
        ids: torch.Tensor
        aux: torch.Tensor | None = field(default=None, init=False)  # set after construction

    class Many(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            h = self.lin(x)
            out = Out(h, torch.arange(2))
            out.aux = h.sum()
            return OrderedDict(h=h), torch.max(h, dim=1), out

    mp.auto_mixed_precision(model := Many(), "mixed_bfloat16", "O2")
    ordered, maximum, out = model(torch.randn(2, 3))
    assert isinstance(ordered, OrderedDict) and ordered["h"].dtype == torch.float32
    assert maximum.values.dtype == torch.float32 and maximum.indices.dtype == torch.int64
    assert isinstance(out, Out) and out.logits.dtype == torch.float32
    assert out.ids.dtype == torch.int64
    assert out.aux is not None and out.aux.dtype == torch.float32 and out.aux.requires_grad


def test_a_dict_dataclass_output_is_rebuilt_from_its_fields_in_one_graph():
    """transformers' ModelOutput is an OrderedDict and a dataclass whose unset fields are
    None and absent from the dict: rebuilt through its constructor, it keeps its type, its
    keys (one set after construction too) and its None fields, and the cast traces
    whole-graph (torch 2.11's dynamo broke the graph on copy.copy, and on
    dataclasses.is_dataclass(None))."""
    from collections import OrderedDict
    from dataclasses import dataclass

    @dataclass
    class Output(OrderedDict):
        logits: torch.Tensor | None = None
        loss: torch.Tensor | None = None
        steps: int = 0

        def __post_init__(self) -> None:
            for name in ("logits", "loss", "steps"):
                if getattr(self, name) is not None:
                    self[name] = getattr(self, name)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            out = Output(logits=self.lin(x), steps=2)
            out["router"] = self.lin(x) * 2  # a key that is not a field
            return out

    mp.auto_mixed_precision(model := Model(), "mixed_bfloat16", "O2")
    out = model(torch.randn(2, 3))
    assert type(out) is Output and list(out) == ["logits", "steps", "router"]
    assert out.logits.dtype == torch.float32 and out["logits"] is out.logits
    assert out["router"].dtype == torch.float32
    assert out.loss is None and out.steps == 2
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(torch.randn(2, 3))
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]


def test_region_recorded():
    m = mp.to_float(nn.Linear(2, 2), "float16")
    region = get_region(m)
    assert region is not None and region.compute_dtype == torch.float16


def test_region_forward_keeps_signature_and_survives_deepcopy():
    """A region is the module's forward wrapped in ``with`` blocks (so that torch.compile
    traces it): it keeps forward's signature (Hugging Face's Trainer reads it), and a deep
    copy runs its own region, not the original's."""
    import copy
    import inspect

    model = mp.auto_mixed_precision(nn.Sequential(nn.Linear(4, 4)), "mixed_bfloat16", "O2")
    assert list(inspect.signature(model.forward).parameters) == ["input"]
    x = torch.randn(2, 4)
    twin = copy.deepcopy(model)
    assert twin.forward.module is twin
    with torch.no_grad():
        twin[0].weight.zero_()  # the copy's own weights: the original's stay as they are
        twin[0].bias.zero_()
    assert twin(x).dtype == torch.float32 and not twin(x).any()
    assert model(x).any()
    mp.region.clear_region(model)
    assert "forward" not in model.__dict__ and model(x.bfloat16()).dtype == torch.bfloat16


def test_upcast_16bit_stores_16_bit_tensors_in_float32_and_says_what():
    """Parameters keep their identity and their gradients follow; a tied weight counts once;
    float64, integer and float32 tensors are left alone; a parameter with a current float32
    copy gets those values back."""
    model = nn.Sequential(nn.Embedding(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 6), nn.Linear(6, 2))
    model[2].weight = model[0].weight  # tied: (6, 4) both
    model[0].to(torch.bfloat16)
    model[1].to(torch.float16)
    model[3].double()
    bias = model[2].bias
    exact = torch.full((6,), 0.1)
    bias.data = exact.bfloat16()  # the copy is current: it rounds to the weight
    bias.grad = torch.ones(6, dtype=torch.bfloat16)
    remember_float32(bias, exact)
    params = [id(p) for p in model.parameters()]
    done = upcast_16bit(model)
    assert [id(p) for p in model.parameters()] == params
    assert sorted((kind, str(dtype), kept) for kind, dtype, kept in done) == [
        ("buffer", "torch.float16", False),  # running_mean, running_var
        ("buffer", "torch.float16", False),
        ("parameter", "torch.bfloat16", False),  # the tied weight, once
        ("parameter", "torch.bfloat16", True),  # the bias, restored
        ("parameter", "torch.float16", False),
        ("parameter", "torch.float16", False),
    ]
    dtypes = {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()]}
    assert dtypes.pop("1.num_batches_tracked") == torch.int64
    assert dtypes.pop("3.weight") == dtypes.pop("3.bias") == torch.float64
    assert set(dtypes.values()) == {torch.float32}
    assert torch.equal(bias, exact)  # 0.1 is not a bfloat16 value: restored
    assert bias.grad.dtype == torch.float32 and model[2].weight is model[0].weight
    assert upcast_16bit(model) == []


def test_regions_ask_torch_which_devices_have_autocast_once_outside_the_graph(monkeypatch):
    # Dynamo before torch 2.13 cannot trace torch's autocast probe (a C builtin): a region
    # that called it each forward broke every compiled graph there (seen on torch 2.11).
    from mixprec import _device

    calls: list[str] = []

    def probe(device_type: str) -> bool:
        calls.append(device_type)
        return device_type == "xpu"

    monkeypatch.setattr(torch.amp, "is_autocast_available", probe)
    monkeypatch.setattr(_device, "AUTOCAST_DEVICES", {"cpu": True, "cuda": True})
    model = mp.auto_mixed_precision(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), "mixed_bfloat16")
    torch.compile(model, fullgraph=True, backend="eager")(torch.randn(2, 4)).sum().backward()
    assert calls == []  # CPU and CUDA are known without asking
    assert _device.autocast_available("xpu") and not _device.autocast_available("mps")
    assert _device.autocast_available("xpu") and calls == ["xpu", "mps"]  # then remembered


def test_float32_functions_keep_an_asked_dtype_and_leave_float64_alone():
    """softmax(..., dtype=float32) inside a 16-bit region returns float32, as under plain
    autocast; float64 arguments are not computed in float32."""
    import torch.nn.functional as F

    h = torch.randn(2, 8).bfloat16()
    x64 = torch.tensor([1.0, 1e-12, 1e-12], dtype=torch.float64)
    with Float32Functions():
        assert F.softmax(h, -1, dtype=torch.float32).dtype == torch.float32
        assert F.softmax(h, -1).dtype == torch.bfloat16
        summed = torch.cumsum(x64, 0)
        # A dtype given by position counts too (it came back bfloat16), and an out= buffer
        # is written, in its own dtype (a float32 copy was returned and the buffer left 0).
        assert torch.log_softmax(h, -1, torch.float32).dtype == torch.float32
        assert h.softmax(-1, torch.float32).dtype == torch.float32
        out = torch.zeros(2, 8, dtype=torch.bfloat16)
        returned = torch.cumsum(h, 1, out=out)
    assert summed.dtype == torch.float64 and torch.equal(summed, torch.cumsum(x64, 0))
    assert returned is out and torch.equal(out, torch.cumsum(h, 1))


def test_keep_float32_none_names_the_argument():
    with pytest.raises(ValueError, match=r"keep_float32=None is invalid; valid: a module type"):
        mp.auto_mixed_precision(nn.Linear(2, 2), "mixed_bfloat16", keep_float32=None)


def test_a_user_dict_output_is_cast_like_a_dict():
    """transformers' BatchEncoding is a UserDict, not a dict."""
    from collections import UserDict

    class Encoded(UserDict):
        pass

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return Encoded(logits=self.lin(x), ids=torch.arange(2))

    out = mp.auto_mixed_precision(Model(), "mixed_bfloat16", "O2")(torch.randn(2, 3))
    assert isinstance(out, Encoded) and out["logits"].dtype == torch.float32
    assert out["ids"].dtype == torch.int64


def test_an_output_object_no_cast_walks_is_said_once_per_type():
    # A SimpleNamespace or a deque came back with bfloat16 tensors where the policy says
    # float32, without a word.
    import collections
    import types
    import warnings

    class Wrapped(nn.Module):
        def __init__(self, make) -> None:
            super().__init__()
            self.lin, self.make = nn.Linear(4, 4), make

        def forward(self, x: torch.Tensor):
            return self.make(self.lin(x))

    # Types of this test's own: the warning is said once per type in a process.
    class Holder(types.SimpleNamespace):
        pass

    class Queue(collections.deque):
        pass

    for make in (lambda h: Holder(logits=h), lambda h: Queue([h])):
        model = mp.auto_mixed_precision(Wrapped(make), "mixed_bfloat16", "O2")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model(torch.randn(2, 4))
            model(torch.randn(2, 4))
        said = [str(w.message) for w in seen if "does not look inside" in str(w.message)]
        assert (
            len(said) == 1
            and "stay bfloat16 instead of the policy's output dtype float32" in (said[0])
        )
        assert seen[0].filename == __file__
    quiet = mp.auto_mixed_precision(Wrapped(lambda h: {"logits": h}), "mixed_bfloat16", "O2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert quiet(torch.randn(2, 4))["logits"].dtype == torch.float32

    class Batch:  # an input object no cast walks is no output: nothing to say
        def __init__(self, x: torch.Tensor) -> None:
            self.x = x

    class TakesBatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, batch: Batch) -> torch.Tensor:
            return self.lin(batch.x)

    model = mp.auto_mixed_precision(TakesBatch(), "mixed_bfloat16", "O2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model(Batch(torch.randn(2, 4))).dtype == torch.float32


class _LogProbs(nn.Module):
    """A head added by hand: its F.log_softmax is one of the float32 functions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x
        return nn.functional.log_softmax(x, dim=-1)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_module_added_after_the_first_forward_gets_the_float32_functions(level):
    """A region cached "no float32 functions needed" for a model of plain layers at its
    first forward; a head added after it ran its log_softmax in bfloat16 (3.1e-2 from the
    float32 result) for the rest of the run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1000))
    model = mp.auto_mixed_precision(model, "mixed_bfloat16", level)
    x = torch.randn(64, 32)
    model(x)  # a first forward: the answer is cached
    model.append(_LogProbs())
    out = model(x)
    logits = model[-1].seen
    assert logits.dtype == torch.bfloat16
    expected = nn.functional.log_softmax(logits.float(), dim=-1).to(logits.dtype).float()
    assert torch.equal(out.float(), expected)


class _RunningMean(nn.Module):
    """A running mean over 4096 steps of values near 20: the running sum passes 65504."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 4)
        nn.init.constant_(self.enc.bias, 20.0)

    def forward(self, x):
        sums = torch.cumsum(self.enc(x), 1)
        self.sums_dtype = sums.dtype
        return sums / torch.arange(1, x.shape[1] + 1)[:, None]


@pytest.mark.parametrize(("policy", "kept"), [("mixed_float16", torch.float32),
                                              ("mixed_bfloat16", torch.bfloat16)])  # fmt: skip
def test_unbounded_reductions_stay_float32_for_float16(policy, kept):
    """A float16 cumsum run in float32 and rounded back became inf past 65504 (20% of the
    outputs, every step skipped); CUDA's autocast returns such results in float32, and
    so does the CPU mode for float16 now. bfloat16 has float32's range: rounded back."""
    torch.manual_seed(0)
    control = _RunningMean()
    x = torch.randn(2, 4096, 8) * 0.1
    model = mp.auto_mixed_precision(copy.deepcopy(control), policy, "O1")
    out = model(x)
    assert model.sums_dtype == kept and torch.isfinite(out).all()
    torch.testing.assert_close(out, control(x), rtol=1e-2, atol=0.0)
