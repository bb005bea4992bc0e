"""torch.compile: prepared models trace whole-graph, and compiled training does not recompile.

Graph breaks are counted with ``torch._dynamo.explain`` (dynamo only, no code generation:
cheap). Recompilation is checked with ``torch._dynamo.config.error_on_recompile`` on the
``eager`` backend, whose guards are dynamo's; inductor adds its own only for float inputs
(its pass that turns them into tensors may specialise them), so the test of a float that
changes (the loss scale in a compiled ``opt.step``) uses inductor. Only those and the few
numerics tests generate code with inductor (seconds per graph on 2 cores); they skip where
no C++ compiler is found.
"""

from __future__ import annotations

import logging
import shutil
import warnings

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec import models, trace
from mixprec.levels import applied
from mixprec.optim import LossScaleOptimizer
from tests.conftest import classification_data, make_mlp

needs_inductor = pytest.mark.skipif(
    not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")),
    reason="inductor needs a C++ compiler to build its CPU kernels",
)


# torch 2.13 replays the eager step bit for bit. torch 2.11's compiled step (backend "eager"
# too) moved some weights by their last bit (an H200 box, 2026-11-26); 2.12 was not tried.
# A doubled or missed unscale moves them by the loss scale's factor, far outside rtol 1e-5.
_BITWISE = torch.__version__ >= (2, 13)


def assert_same_weights(eager: list[torch.Tensor], compiled: list[torch.Tensor]) -> None:
    for a, b in zip(eager, compiled, strict=True):
        if _BITWISE:
            assert torch.equal(a, b)
        elif a.dtype in (torch.float16, torch.bfloat16):
            # O3's 16-bit weights take each update without a float32 master: torch 2.11's
            # compiled step rounded some differently (at most 1.2e-4, an ulp or two at the
            # weights' scale, on the same H200 box). A doubled or missed unscale moves a
            # weight by a whole update, lr times the gradient, far past two ulps.
            ulp = torch.finfo(a.dtype).eps * float(a.abs().max())
            torch.testing.assert_close(b, a, rtol=0.0, atol=2 * ulp)
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-8)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _families():
    """(name, model factory, inputs) of each reference model family, at toy sizes."""
    return {
        "mlp": (lambda: models.mlp(16, 16, 1, 4), lambda: (torch.randn(4, 16),)),
        "cnn": (lambda: models.cnn(1, 4, 8), lambda: (torch.randn(2, 1, 8, 8),)),
        "lm": (
            lambda: models.CausalLM(vocab=32, d_model=16, n_layers=1, n_heads=2, max_len=8),
            lambda: (torch.randint(0, 32, (2, 8)),),
        ),
        "speech": (
            lambda: models.SpeechCTC(n_mels=8, n_tokens=5, hidden=16),
            lambda: (torch.randn(2, 12, 8),),
        ),
        "recommender-sparse": (
            lambda: models.Recommender((10, 10), 4, 8, sparse=True),
            lambda: (torch.randint(0, 10, (4, 2)),),
        ),
        "recommender-dense": (
            lambda: models.Recommender((10, 10), 4, 8, sparse=False),
            lambda: (torch.randint(0, 10, (4, 2)),),
        ),
    }


def graph_breaks(model: nn.Module, *args, **kwargs) -> tuple[int, list[str]]:
    # Dynamo declines RNNs unless allowed (a PyTorch default, float32 models too); mixprec's
    # compile=True allows them for models that have them (mixprec._compile).
    with torch._dynamo.config.patch(allow_rnn=True):
        explained = torch._dynamo.explain(model)(*args, **kwargs)
    return explained.graph_break_count, [str(r.reason)[:200] for r in explained.break_reasons]


CASES = [
    (policy, level)
    for policy in ("mixed_bfloat16", "mixed_float16")
    for level in ("O0", "O1", "O2", "O3")
    if policy == "mixed_bfloat16" or level != "O0"
]


@pytest.mark.parametrize("family", list(_families()))
@pytest.mark.parametrize(("policy", "level"), CASES)
def test_reference_models_trace_whole_graph(family, policy, level):
    make, inputs = _families()[family]
    model = mp.auto_mixed_precision(make(), policy, level)
    assert graph_breaks(model, *inputs()) == (0, [])


class Mixed(nn.Module):
    """Every kind of region in one model: dense and sparse embeddings, normalisation islands
    (GroupNorm, RMSNorm, LayerNorm), a softmax module, keep_float32 and to_float overrides."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.sparse = nn.Embedding(20, 16, sparse=True)
        self.proj = nn.Linear(16, 16)
        self.group = nn.GroupNorm(4, 16)
        self.rms = nn.RMSNorm(16)
        self.kept = nn.Linear(16, 16)
        self.custom = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)
        self.softmax = nn.LogSoftmax(-1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed(ids) + self.sparse(ids))
        h = self.group(h.transpose(1, 2)).transpose(1, 2)
        h = self.custom(self.kept(self.rms(h)))
        return self.softmax(self.head(torch.relu(self.norm(h))))


@pytest.mark.parametrize(("policy", "level"), [c for c in CASES if c[1] != "O0"])
def test_overrides_islands_and_embeddings_trace_whole_graph(policy, level):
    model = Mixed()
    mp.to_float(model.custom, "float32")
    mp.auto_mixed_precision(model, policy, level, keep_float32=["kept"])
    ids = torch.randint(0, 20, (2, 6))
    eager = model(ids)
    assert graph_breaks(model, ids) == (0, [])
    assert eager.dtype == torch.float32 and torch.isfinite(eager).all()


def _lso_step(compiled: nn.Module, lso: LossScaleOptimizer, x, y) -> mp.StepResult:
    lso.zero_grad()
    lso.backward(nn.functional.cross_entropy(compiled(x), y))
    return lso.step()


def test_no_recompile_on_overflow_scale_change_accumulation_or_mode_switch():
    x, y = classification_data(n=32)
    bad = x.clone()
    bad[0, 0] = float("inf")  # an overflow in the forward: the step is skipped
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    lso = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    # Warm-up: one graph for training, one for evaluation under no_grad.
    assert _lso_step(compiled, lso, x, y).applied
    model.eval()
    with torch.no_grad():
        compiled(x)
    model.train()
    with torch._dynamo.config.patch(error_on_recompile=True):
        skipped = _lso_step(compiled, lso, bad, y)
        assert skipped.skipped and skipped.found_inf
        assert skipped.scale != _lso_step(compiled, lso, x, y).scale  # the scale backed off
        model.eval()
        with torch.no_grad():
            compiled(x)
        model.train()
        assert _lso_step(compiled, lso, x, y).applied


def test_no_recompile_when_modules_are_built_elsewhere():
    """Regions look again at their modules when one is added to them (a head appended
    after the first forward); a module built anywhere else must not count as one, or a
    compiled model recompiled at each (and failed past 8 with fullgraph=True)."""
    x, _ = classification_data(n=8)
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    compiled(x)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            nn.Sequential(nn.Linear(2, 2))  # another model, built between calls
            compiled(x)


def test_no_recompile_across_accumulation_micro_steps():
    x, y = classification_data(n=32)
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    step = mp.build_train_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        "cross_entropy",
        accumulation_steps=2,
        compile={"backend": "eager", "fullgraph": True},
    )
    assert step(x[:16], y[:16])[1].accumulating  # warm-up: the first micro-step
    with torch._dynamo.config.patch(error_on_recompile=True):
        results = [step(x[i : i + 16], y[i : i + 16])[1] for i in (16, 0, 16, 0)]
    assert [r.accumulating for r in results] == [False, True, False, True]
    assert all(r.applied for r in results[0::2])


def test_compile_option_is_checked():
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"compile='yes' is invalid; pass True, False or a dict"):
        mp.build_train_step(model, opt, "cross_entropy", "mixed_bfloat16", compile="yes")
    with pytest.raises(ValueError, match=r"unknown torch.compile option\(s\) fulgraph; valid: "):
        mp.Trainer(model, "cross_entropy", opt, "mixed_bfloat16", compile={"fulgraph": True})
    assert applied(model) is None  # a bad option fails before the model is changed
    # A value torch refuses, too: it failed in torch.compile after the model and the
    # optimizer were changed, and the retry then found the optimizer over other tensors.
    for bad, said in (({"mode": "bogus"}, "Unrecognized mode=bogus"),
                      ({"backend": "no_such_backend"}, "Invalid backend")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"is refused by torch.compile: {said}"):
            mp.build_train_step(model, opt, "cross_entropy", "mixed_bfloat16", compile=bad)
    assert applied(model) is None and all(p.dtype == torch.float32 for p in model.parameters())
    options = {"mode": "max-autotune-no-cudagraphs", "dynamic": True}  # values torch takes
    mp.build_train_step(model, opt, "cross_entropy", "mixed_bfloat16", compile=options)


def test_past_the_recompile_limit_a_compiled_prepared_model_is_said(monkeypatch):
    # Each prepared model's forward is compiled anew; past the limit dynamo runs it eagerly.
    import weakref

    from mixprec import _compile

    monkeypatch.setattr(_compile, "_COMPILED", weakref.WeakSet())
    monkeypatch.setattr(_compile, "_COUNT", [0])
    limit = torch._dynamo.config.patch(recompile_limit=2)
    with limit, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        steps = []
        for _ in range(3):
            model = make_mlp()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            steps.append(mp.build_train_step(model, opt, "cross_entropy", "mixed_bfloat16",
                                             compile={"backend": "eager"}))  # fmt: skip
            if len(steps) == 2:  # at the limit: nothing said yet
                assert not [w for w in seen if "prepared models compiled" in str(w.message)]
    said = [str(w.message) for w in seen if "prepared models compiled" in str(w.message)]
    assert said == [said[0]] and "3 prepared models compiled in this process" in said[0]


@pytest.mark.parametrize(
    ("compile", "copied"),
    [
        (False, False),
        (True, True),
        ({"mode": "reduce-overhead"}, True),
        ({"backend": "cudagraphs"}, True),
    ],
)
def test_train_step_copies_its_loss_out_of_cuda_graph_memory(compile, copied):
    # A CUDA graph's next replay overwrites the loss it returned, and torch then refuses to
    # read a kept one. Graphs can be switched on outside `compile` (inductor's config, its
    # environment variable), so every compiled step copies. On CPU there is no graph: the
    # forward is replaced by one whose loss is known.
    x, y = classification_data(n=8)
    model = make_mlp()
    step = mp.build_train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "cross_entropy", compile=compile
    )
    produced = []

    def forward_loss(xb, yb):
        output = model(xb)
        produced.append(nn.functional.cross_entropy(output, yb))
        return produced[-1], output

    step._forward_loss = forward_loss
    loss, _ = step(x, y)
    assert torch.equal(loss, produced[0].detach())
    assert (loss.data_ptr() != produced[0].data_ptr()) is copied


def _train(compile, policy: str, level: str, steps: int = 5) -> list[float]:
    torch.manual_seed(0)
    x, y = classification_data(n=64)
    x[21, 3] = float("inf")  # batch 1 overflows: skipped in both runs alike
    model = make_mlp()
    step = mp.build_train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "cross_entropy", policy, level,
        compile=compile,
    )  # fmt: skip
    losses = []
    for i in range(steps):
        j = (i % 4) * 16
        loss, result = step(x[j : j + 16], y[j : j + 16])
        losses.append(float(loss) if result.applied else float("nan"))
    return losses


@needs_inductor
@pytest.mark.parametrize(("policy", "level"), [("mixed_float16", "O2"), ("mixed_bfloat16", "O1")])
def test_compiled_training_matches_eager(policy, level):
    eager = _train(False, policy, level)
    compiled = _train({"fullgraph": True}, policy, level)
    # Same skipped step; the losses differ only by the order inductor sums in, far inside the
    # eager convergence tests' tolerance against float32 (2e-2 for bfloat16): 1e-3 relative.
    assert [v != v for v in eager] == [v != v for v in compiled] == [False, True] + [False] * 3
    finite = [(a, b) for a, b in zip(eager, compiled, strict=True) if a == a]
    for a, b in finite:
        assert b == pytest.approx(a, rel=1e-3)


@needs_inductor
def test_compiled_float32_islands_save_16bit_activations():
    """Eager regions save a 16-bit copy of an island's upcast input through saved-tensor
    hooks, which do not trace; compiled, the partitioner does the same on its own: no float32
    activation is saved for backward, and no more bytes in all than eagerly."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.GroupNorm(8, 256), nn.Linear(256, 64), nn.LayerNorm(64),
        nn.Linear(64, 8),
    )  # fmt: skip
    mp.auto_mixed_precision(model, "mixed_bfloat16", "O2")
    x = torch.randn(128, 64)
    compiled = torch.compile(model, fullgraph=True)
    compiled(x).sum().backward()  # compile outside the measurement

    def saved(run) -> list[torch.Tensor]:
        kept: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
        return kept

    eager = saved(lambda: model(x))
    graph = saved(lambda: compiled(x))
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    assert nbytes(graph) <= nbytes(eager)
    assert not [t.shape for t in graph if t.dtype == torch.float32 and t.shape[0] == 128 and
                t.dim() == 2 and t.shape[1] in (64, 256)]  # fmt: skip


def test_cross_entropy_says_once_when_logits_come_from_a_compiled_graph():
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x, y = classification_data(n=8)
    mp.losses._warn_compiled_output.cache_clear()  # once per process: start afresh
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            loss = mp.cross_entropy(compiled(x), y)
    said = [str(w.message) for w in caught if "torch.compile'd model" in str(w.message)]
    assert len(said) == 1 and "Compile the loss together with the model" in said[0]
    eager = mp.cross_entropy(model(x), y)
    assert loss.item() == pytest.approx(eager.item(), rel=1e-3)


def test_trace_overflow_is_off_under_compile_and_says_so_once():
    x, y = classification_data(n=16)
    bad = x.clone()
    bad[0, 0] = float("inf")
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    lso = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), trace_overflow=True)
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # the hooks still trace
    trace._warn_off_under_compile.cache_clear()  # once per process: start afresh
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [_lso_step(compiled, lso, batch, y) for batch in (bad, bad)]
    said = [str(w.message) for w in caught if "trace_overflow" in str(w.message)]
    assert len(said) == 1 and "StepResult.overflow stays None" in said[0]
    assert all(r.skipped and r.overflow is None for r in results)
    # Eagerly the same model and optimizer name the layer.
    eager = _lso_step(model, lso, bad, y)
    assert eager.skipped and eager.overflow is not None and eager.overflow.module == "0"


def test_diagnose_runs_a_compiled_model_eagerly():
    x, y = classification_data(n=32)
    loss = nn.functional.cross_entropy
    compiled = torch.compile(make_mlp(), backend="eager")
    with pytest.warns(UserWarning, match="diagnose runs the model eagerly"):
        report = mp.diagnose(compiled, x, y, loss, policy="mixed_float16")
    expected = mp.diagnose(make_mlp(), x, y, loss, policy="mixed_float16")
    assert report.loss_mixed == expected.loss_mixed and report.loss_float32 == expected.loss_float32
    assert [m.name for m in report.modules] == [m.name for m in expected.modules]


@needs_inductor
def test_compiled_optimizer_step_matches_eager_bit_for_bit():
    """``torch.compile(opt.step)``, as with PyTorch's compiled optimizers: the same skips,
    scales and weights as the eager step (it compiles in three pieces; see docs/compile.md)."""
    x, y = classification_data(n=16)

    def run(compile: bool) -> tuple[list[tuple[bool, float]], list[torch.Tensor]]:
        model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
        lso = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
        step = torch.compile(lso.step) if compile else lso.step
        seen = []
        for i in range(4):
            batch = x.clone()
            if i == 1:
                batch[0, 0] = float("inf")
            lso.zero_grad()
            lso.backward(nn.functional.cross_entropy(model(batch), y))
            result = step()
            seen.append((result.applied, result.scale))
        return seen, [p.detach().clone() for p in model.parameters()]

    eager, eager_weights = run(False)
    compiled, compiled_weights = run(True)
    assert compiled == eager == [(True, 65536.0), (False, 65536.0), (True, 32768.0),
                                 (True, 32768.0)]  # fmt: skip
    assert_same_weights(eager_weights, compiled_weights)


@needs_inductor
@pytest.mark.skipif(
    torch.__version__ < (2, 13),
    reason="torch 2.11's dynamo guards on the float scale's value: a recompile per new scale",
)
def test_compiled_optimizer_step_does_not_recompile_per_loss_scale():
    """The loss scale is a graph input of the compiled step's unscale, not a constant: the
    first scale change compiles once more (dynamo makes the scale dynamic), later back-offs
    and growths compile nothing. A constant would recompile on every new scale and fall back
    to eager after ``recompile_limit`` of them. Inductor, not the ``eager`` backend: the
    specialisation came from inductor's pass that turns float inputs into tensors."""
    x, y = classification_data(n=16)
    bad = x.clone()
    bad[0, 0] = float("inf")
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    scaler = mp.DynamicLossScaler(init_scale=4.0, growth_interval=2)
    lso = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler)
    step = torch.compile(lso.step)

    def train(batch: torch.Tensor) -> mp.StepResult:
        lso.zero_grad()
        lso.backward(nn.functional.cross_entropy(model(batch), y))
        return step()

    # Warm-up: an applied step, an overflow (the first new scale) and an applied step.
    assert [train(b).applied for b in (x, bad, x)] == [True, False, True]
    with torch._dynamo.config.patch(error_on_recompile=True):
        results = [train(b) for b in (bad, x, x, x, bad, x)]
    assert [r.applied for r in results] == [False, True, True, True, False, True]
    # 2 backs off to the floor, 1; two clean steps grow it to 2; an overflow, 1 again.
    assert [r.scale for r in results] == [2.0, 1.0, 1.0, 2.0, 2.0, 1.0]


@pytest.mark.parametrize(
    ("level", "accumulation"), [("O1", 1), ("O2", 1), ("O3", 1), ("O1", 2), ("O2", 2)]
)
def test_compiled_optimizer_step_keeps_its_bookkeeping(level, accumulation):
    """What a step leaves for the next (a backward seen, micro-steps, the found_inf flag)
    survives ``torch.compile(opt.step)``. Dynamo dropped some attribute writes on the
    optimizer itself: without accumulation, the O1 and O3 steps read a found_inf they had
    just set as None and raised, and at every level a second step without a backward ran
    (unscaling the same gradients twice) instead of being refused."""
    x, y = classification_data(n=32)
    bad = x.clone()
    bad[0, 0] = float("inf")
    batches = {1: (x, bad, x, x), 2: (x, x, bad, x, x, x)}[accumulation]

    def run(compiled: bool) -> tuple[list[tuple[bool, bool, float]], list[torch.Tensor]]:
        torch._dynamo.reset()
        model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", level)
        lso = mp.LossScaleOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=accumulation
        )
        step = torch.compile(lso.step, backend="eager") if compiled else lso.step
        seen = []
        for batch in batches:
            lso.backward(nn.functional.cross_entropy(model(batch), y))
            result = step()
            seen.append((result.accumulating, result.applied, result.scale))
            if not result.accumulating:
                lso.zero_grad()
        with pytest.raises(mp.MisuseError, match="without a new backward"):
            step()
        return seen, [p.detach().clone() for p in model.parameters()]

    eager, eager_weights = run(False)
    compiled, compiled_weights = run(True)
    assert compiled == eager
    applied = {1: [True, False, True, True], 2: [False, True, False, False, False, True]}
    assert [a for _, a, _ in eager] == applied[accumulation]
    assert_same_weights(eager_weights, compiled_weights)


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_grad_scaler_step_matches_eager(fused):
    """``mp.GradScaler.step`` inside compiled code, as ``torch.amp.GradScaler``'s: with a
    fused optimizer (unscale and skip in its kernel) it raised AttributeError, as dynamo
    dropped the grad_scale attribute set on the optimizer; now that part runs eagerly."""
    x = torch.randn(16, 8)

    def run(compiled: bool) -> tuple[list[float], list[torch.Tensor]]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
        scaler = mp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        step = torch.compile(scaler.step, backend="eager") if compiled else scaler.step
        scales = []
        for bad in (False, True, False, False):
            opt.zero_grad()
            loss = model(x).square().mean() * (float("inf") if bad else 1.0)
            scaler.scale(loss).backward()
            step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [p.detach().clone() for p in model.parameters()]

    eager, eager_weights = run(False)
    compiled, compiled_weights = run(True)
    assert compiled == eager == [2048.0, 1024.0, 2048.0, 4096.0]
    assert_same_weights(eager_weights, compiled_weights)


class _Chatty(nn.Module):
    """A model with a graph break of its own: it logs in its forward (as transformers does
    for an unset ``loss_type``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        logging.getLogger("tests.chatty").info("forward")
        return self.b(h).softmax(-1)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_models_own_graph_break_costs_no_more_than_under_autocast(level):
    """A break inside a region resumes as it does inside a hand-written autocast block: no
    re-entry of the region at every break until dynamo's recompile limit (seen when the
    region called a bound method it made with __get__)."""
    x = torch.randn(2, 8)
    plain = _Chatty()

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return plain(x).float()

    expected = torch._dynamo.explain(by_hand)(x).graph_break_count
    torch._dynamo.reset()
    model = mp.auto_mixed_precision(_Chatty(), "mixed_bfloat16", level)
    assert torch._dynamo.explain(model)(x).graph_break_count == expected


def test_recompile_room_compiles_every_closure_of_one_function():
    """Closures of one function share its code object: dynamo compiled 8 versions and ran
    the 9th eagerly, still labelled compiled (the bench's 9th +compile mode)."""
    from torch._dynamo.utils import counters

    from mixprec._compile import recompile_room

    def make(i: int):
        # Models of other structures, as the bench's modes' are: each fails the last
        # version's guards, so each call compiles a version of its own.
        net = nn.Sequential(*[nn.Identity() for _ in range(i + 1)])

        def step(x: torch.Tensor) -> torch.Tensor:
            return net(x) + 1

        return torch.compile(step, backend="eager")

    def frames_compiled(n: int) -> int:
        torch._dynamo.reset()
        counters.clear()
        for i in range(n):
            make(i)(torch.ones(2))
        return int(counters["frames"]["ok"])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's own note on hitting its limit
        assert frames_compiled(10) == 8  # the limit: two ran eagerly
    with recompile_room(10):
        assert frames_compiled(10) == 10
    torch._dynamo.reset()


@pytest.mark.parametrize(("policy", "level"), [("mixed_bfloat16", "O2"), ("mixed_float16", "O1")])
def test_torch_export_keeps_the_region(policy, level):
    """Non-strict ``torch.export`` read ``forward.__code__``, which the region's forward
    lacked: a raw AttributeError."""
    model = mp.auto_mixed_precision(make_mlp(), policy, level).eval()
    x = classification_data(n=8)[0]
    exported = torch.export.export(model, (x,))
    out = exported.module()(x)
    assert out.dtype == torch.float32 and torch.equal(out, model(x))
