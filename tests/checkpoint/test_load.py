"""load_checkpoint: a float32 checkpoint into a 16-bit model and back, key mismatches, the
optimizer state's messages, and all or nothing: a failed load changes nothing."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import mixprec as mp
from tests.checkpoint._helpers import node_at, rewrite_header, set_node, trained
from tests.conftest import make_mlp


def test_float32_checkpoint_into_16_bit_model_and_back(tmp_path):
    reference = make_mlp()
    path = mp.save_checkpoint(tmp_path / "f32.safetensors", reference)
    half = mp.auto_mixed_precision(make_mlp(seed=5), "mixed_float16", "O2")
    report = mp.load_checkpoint(path, half)
    assert ("0.weight", "float32", "float16") in report.converted
    assert ("3.weight", "float32", "float16") not in report.converted  # LayerNorm: float32
    assert half[0].weight.dtype == torch.float16
    assert torch.equal(half[0].weight, reference[0].weight.half())
    # A LossScaleOptimizer built afterwards starts from the exact float32 values.
    opt = mp.LossScaleOptimizer(torch.optim.SGD(half.parameters(), lr=0.1))
    masters = dict(opt.master_weights())
    assert torch.equal(masters[half[0].weight], reference[0].weight)
    # and back: the 16-bit model's checkpoint (masters, float32) into a float32 model
    back = make_mlp(seed=7)
    path2 = mp.save_checkpoint(tmp_path / "half.safetensors", half, opt)
    report2 = mp.load_checkpoint(path2, back)
    assert report2.converted == []  # masters were stored: float32 already
    assert torch.equal(back[0].weight, reference[0].weight)


def test_key_mismatches_listed_in_one_error(tmp_path):
    path = mp.save_checkpoint(tmp_path / "mlp.safetensors", make_mlp())
    wider = make_mlp(hidden=80)
    with pytest.raises(mp.CheckpointError, match="does not match the model") as err:
        mp.load_checkpoint(path, wider)
    text = str(err.value)
    assert "shape mismatch 0.weight: saved (64, 32), model (80, 32)" in text
    other = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 10))
    with pytest.raises(mp.CheckpointError) as err:
        mp.load_checkpoint(path, other)
    assert "missing: 1.weight, 1.bias" in str(err.value)
    assert "unexpected: 2.bias, 2.weight, 3.bias, 3.weight, 5.bias, 5.weight" in str(err.value)
    report = mp.load_checkpoint(path, other, strict=False)
    assert report.missing == ["1.weight", "1.bias"] and torch.equal(
        other[0].weight, make_mlp()[0].weight
    )


def test_damaged_optimizer_state_message_does_not_contradict_itself(tmp_path):
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    path = mp.save_checkpoint(tmp_path / "c.safetensors", model, opt)

    def drop(meta):
        del meta["optimizer"]["__dict__"][0]  # the first saved key: 'optimizers'

    rewrite_header(path, drop)
    fresh = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    fresh_opt = mp.LossScaleOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.1))
    # Not "optimizer state is from a LossScaleOptimizer, not a LossScaleOptimizer".
    with pytest.raises(mp.CheckpointError, match="has no 'optimizers' entry"):
        mp.load_checkpoint(path, fresh, fresh_opt)


def _state(model, opt):
    """Everything a load may change, copied."""
    return copy.deepcopy(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scaler": opt.loss_scaler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
    )


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


_PARAM_0 = ("optimizers", 0, "state", 0)  # the inner Adam's state of the first parameter


def _python_rng_too_short(meta):
    set_node(meta["rng"], {"__tuple__": [3, {"__tuple__": [1, 2]}, None]}, "python")


def _torch_rng_too_short(meta):
    set_node(meta["rng"], {"__tensor__": "trainer/blob"}, "torch")


def _step_not_a_number(meta):
    set_node(meta["optimizer"], "abc", *_PARAM_0, "step")


def _step_missing(meta):
    exp_avg = node_at(meta["optimizer"], *_PARAM_0, "exp_avg")
    set_node(meta["optimizer"], {"__dict__": [["exp_avg", exp_avg]]}, *_PARAM_0)


def _extra_param_group(meta):
    groups = node_at(meta["optimizer"], "optimizers", 0, "param_groups")
    groups.append(groups[0])


def _negative_scale(meta):
    set_node(meta["optimizer"], -1.0, "loss_scaler", "scale")


def _micro_steps_not_an_int(meta):
    set_node(meta["optimizer"], "abc", "micro_steps")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_python_rng_too_short, r"RNG state cannot be restored \(state vector is the wrong size"),
        (_torch_rng_too_short, r"RNG state cannot be restored \(Expected a CPUGeneratorImpl"),
        (_step_not_a_number, "optimizer state does not fit this optimizer: ValueError"),
        (_step_missing, "optimizer state does not fit this optimizer: KeyError: 'step'"),
        (_extra_param_group, "ValueError: loaded state dict has a different number of param"),
        (_negative_scale, "loss scaler state does not load"),
        (_micro_steps_not_an_int, "optimizer state: 'micro_steps' is 'abc'; valid: an int >= 0"),
    ],
)
def test_a_failed_load_changes_nothing(tmp_path, edit, match):
    model, opt = trained("mixed_float16", "O2", steps=1)
    intact = mp.save_checkpoint(tmp_path / "intact.safetensors", model, opt)
    path = mp.save_checkpoint(
        tmp_path / "c.safetensors", model, opt, {"blob": torch.zeros(3, dtype=torch.uint8)}
    )
    rewrite_header(path, edit)
    target, target_opt = trained("mixed_float16", "O2", steps=1, model=make_mlp(seed=4))
    torch.manual_seed(123)
    random.seed(123)
    before = _state(target, target_opt)
    # The weights, the first inner optimizer, the scaler and the torch RNG are as they were
    # when the optimizer or RNG state fails.
    with pytest.raises(mp.CheckpointError, match=match):
        mp.load_checkpoint(path, target, target_opt, restore_rng=True)
    assert _same(before, _state(target, target_opt))
    # The same load with the file intact does change all of it: the comparison can fail.
    mp.load_checkpoint(intact, target, target_opt, restore_rng=True)
    after = _state(target, target_opt)
    assert not any(_same(before[k], after[k]) for k in ("model", "optimizer", "torch_rng"))


def _stepped(make_optimizer, model=None):
    """``model`` (an MLP by default) and ``make_optimizer(params)`` after one step."""
    model = model or make_mlp()
    opt = make_optimizer(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    return model, opt


def test_optimizer_state_of_another_class_is_refused_naming_both(tmp_path):
    trained_model, adamw = _stepped(lambda p: torch.optim.AdamW(p, lr=1e-2))
    path = mp.save_checkpoint(tmp_path / "c.safetensors", trained_model, adamw)
    # Torch would load AdamW's state into an Adam (which then decouples its weight decay)
    # and into an SGD (which then fails at its first step with KeyError: 'momentum').
    for other in (torch.optim.Adam, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)):
        model, opt = _stepped(other, make_mlp(seed=2))
        before = copy.deepcopy((model.state_dict(), opt.state_dict()))
        name = type(opt).__name__
        with pytest.raises(
            mp.CheckpointError, match=rf"optimizer state is from AdamW, this optimizer is {name};"
        ):
            mp.load_checkpoint(path, model, opt)
        assert _same(before, (model.state_dict(), opt.state_dict()))
    fresh = make_mlp(seed=2)
    mp.load_checkpoint(path, fresh, torch.optim.AdamW(fresh.parameters()))


def test_a_scaler_of_another_policy_is_refused_with_the_way_to_load_the_model(tmp_path):
    """A bfloat16 run's checkpoint into a float16 run: the scaler states differ in kind, and
    the error named the classes alone, not that the model loads without the optimizer."""
    model, opt = trained("mixed_bfloat16", "O2", steps=1)
    path = mp.save_checkpoint(tmp_path / "c.safetensors", model, opt)
    half, half_opt = trained("mixed_float16", "O2", steps=0)
    with pytest.raises(mp.CheckpointError, match=r"loss scaler state does not load: .* cannot "
                       r"load into DynamicLossScaler \(saved with another policy: float32 and "
                       r"bfloat16 runs scale no loss, float16 runs do; load the model alone, "
                       r"load_checkpoint\(path, model\), and start its optimizer"):  # fmt: skip
        mp.load_checkpoint(path, half, half_opt)
    # The same policy, another scaler: not said to be another policy.
    static = mp.LossScaleOptimizer(torch.optim.Adam(half.parameters()), mp.StaticLossScaler(1024))
    with pytest.raises(mp.CheckpointError, match=r"cannot load into StaticLossScaler \(saved "
                       r"with another loss scaler: give the optimizer one of its kind, or load "
                       r"the model alone"):  # fmt: skip
        mp.load_checkpoint(mp.save_checkpoint(tmp_path / "h.safetensors", half, half_opt),
                           half, static)  # fmt: skip
    mp.load_checkpoint(path, half)  # as the error says
    master = dict(opt.master_weights())[model[0].weight]
    assert torch.equal(half[0].weight, master.to(torch.float16))


def test_inner_optimizer_of_another_class_is_refused_and_older_files_still_load(tmp_path):
    model, opt = trained("mixed_float16", "O2", steps=1)  # a LossScaleOptimizer over Adam
    path = mp.save_checkpoint(tmp_path / "c.safetensors", model, opt)
    target = mp.auto_mixed_precision(make_mlp(seed=3), "mixed_float16", "O2")
    sgd = mp.LossScaleOptimizer(torch.optim.SGD(target.parameters(), lr=0.1))
    with pytest.raises(mp.CheckpointError, match="from Adam, this optimizer is SGD;"):
        mp.load_checkpoint(path, target, sgd)
    # A checkpoint written before the classes were recorded loads into the same class ...
    rewrite_header(path, lambda meta: meta.pop("optimizer_classes"))
    adam = mp.LossScaleOptimizer(torch.optim.Adam(target.parameters(), lr=1e-2, eps=1e-4))
    mp.load_checkpoint(path, target, adam)
    assert opt.loss_scaler.state == adam.loss_scaler.state
    # ... and a plain optimizer's class is its kind, which such a checkpoint holds.
    plain_model, plain = _stepped(lambda p: torch.optim.AdamW(p, lr=1e-2))
    old = mp.save_checkpoint(tmp_path / "plain.safetensors", plain_model, plain)
    rewrite_header(old, lambda meta: meta.pop("optimizer_classes"))
    with pytest.raises(mp.CheckpointError, match="from AdamW, this optimizer is Adam;"):
        fresh = make_mlp()
        mp.load_checkpoint(old, fresh, torch.optim.Adam(fresh.parameters()))


def test_arguments_of_the_wrong_kind_are_refused_by_name(tmp_path):
    # strict=None loaded a partial model, strict="false" was strict; a state dict or an
    # optimizer's name failed as an AttributeError; a complex128 entry as a bare KeyError.
    import re

    model = make_mlp()
    path = mp.save_checkpoint(tmp_path / "c.safetensors", model)
    for name, value in (("strict", None), ("strict", "false"), ("restore_rng", 0)):
        message = f"load_checkpoint({name}={value!r}) is invalid; valid: True or False"
        with pytest.raises(mp.ArgumentError, match=re.escape(message)):
            mp.load_checkpoint(path, make_mlp(), **{name: value})
    for call in (mp.load_checkpoint, mp.save_checkpoint):
        with pytest.raises(mp.ArgumentError, match=r"needs an nn.Module, got OrderedDict \(a st"):
            call(path, model.state_dict())
        with pytest.raises(mp.ArgumentError, match=r"\(optimizer='adam'\) is invalid; valid: a t"):
            call(path, model, "adam")
    with pytest.raises(mp.ArgumentError, match=r"trainer_state=\[1, 2\]\) is invalid; valid: a d"):
        mp.save_checkpoint(path, model, trainer_state=[1, 2])
    with pytest.raises(mp.ArgumentError, match=r"'trainer/z'.*dtype complex128 is not one safet"):
        mp.save_checkpoint(path, model, trainer_state={"z": torch.ones(2, dtype=torch.complex128)})
    with pytest.raises(mp.ArgumentError, match=r"dict key of type tuple \(\(1, 2\)\)"):
        mp.save_checkpoint(path, model, trainer_state={(1, 2): 3})
    assert mp.load_checkpoint(path, make_mlp()).missing == []  # the file is still whole


def test_a_resume_in_another_precision_than_the_checkpoints_is_said(tmp_path):
    """Saved where ``auto`` was mixed_bfloat16 at O2, resumed where it is float32 (or with
    another policy by hand): the run went on in the new precision unsaid, 4.9e-4 off the
    uninterrupted one after an epoch, and at O3 with its masters rounded."""
    import warnings

    model, opt = trained("mixed_bfloat16", "O2")
    path = mp.save_checkpoint(tmp_path / "o2.safetensors", model, opt)

    def resume(policy, level):
        again = mp.auto_mixed_precision(make_mlp(seed=5), policy, level)
        return again, mp.LossScaleOptimizer(torch.optim.Adam(again.parameters(), lr=1e-2))

    plain = make_mlp(seed=5)  # never prepared: float32, as auto picks without fast bf16
    plain_opt = mp.LossScaleOptimizer(torch.optim.Adam(plain.parameters(), lr=1e-2))
    with pytest.warns(UserWarning, match=r"o2\.safetensors was trained with mixed_bfloat16 at "
                      r"O2; this model is prepared with float32 at O0: training resumes so, "
                      r".*policy='mixed_bfloat16', level='O2'") as seen:  # fmt: skip
        mp.load_checkpoint(path, plain, plain_opt)
    assert [w.filename for w in seen] == [__file__]
    with pytest.warns(UserWarning, match=r"prepared with bfloat16 at O3: .*float32 masters "
                      r"rounded to 16 bits"):  # fmt: skip
        mp.load_checkpoint(path, *resume("bfloat16", "O3"))
    with pytest.warns(UserWarning, match=r"prepared with mixed_bfloat16 at O1"):
        mp.load_checkpoint(path, *resume("mixed_bfloat16", "O1"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.load_checkpoint(path, *resume("mixed_bfloat16", "O2"))  # as it was trained
        mp.load_checkpoint(path, make_mlp(seed=5))  # weights alone: a new run's choice


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [(("float32", "O1"), ("float32", "O2")), (("mixed_bfloat16", "O0"), None)],
    ids=["float32-levels", "O0-to-unprepared"],
)
def test_a_resume_between_two_ways_of_training_float32_says_nothing(tmp_path, saved, resumed):
    """The float32 policy at O1 or O2, any policy at O0, and a model never prepared all
    train in float32: a resume between them changes nothing to say."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "level=O2 with the float32 policy changes nothing"
        model, opt = trained(*saved)
        path = mp.save_checkpoint(tmp_path / "f32.safetensors", model, opt)
        again = make_mlp(seed=5)
        if resumed is not None:
            again = mp.auto_mixed_precision(again, *resumed)
    again_opt = mp.LossScaleOptimizer(torch.optim.Adam(again.parameters(), lr=1e-2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.load_checkpoint(path, again, again_opt)
