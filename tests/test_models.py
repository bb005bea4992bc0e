"""Reference models: output shapes, causality of the LM, float32 losses, CTC training,
sparse embedding gradients, and the registry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixprec import ArgumentError
from mixprec.models import (
    MODELS,
    CausalLM,
    Recommender,
    SpeechCTC,
    cnn,
    ctc_loss,
    get_model,
    lm_loss,
    mlp,
    synthetic_speech,
)


def test_mlp_follows_input_shape():
    model = mlp((8, 8), hidden=32)
    assert model(torch.rand(5, 8, 8)).shape == (5, 10)
    assert model[1].in_features == 64
    default = mlp()
    assert [type(m).__name__ for m in default] == [
        "Flatten", "Linear", "ReLU", "Linear", "ReLU", "Linear",
    ]  # fmt: skip
    assert default[1].in_features == 784 and default[1].out_features == 512
    assert mlp(784, depth=0, classes=3)(torch.rand(2, 784)).shape == (2, 3)
    assert all(p.dtype == torch.float32 for p in default.parameters())


def test_mlp_bad_shape():
    with pytest.raises(ValueError, match=r"input_shape=\(8, 0\) is invalid"):
        mlp((8, 0))


def test_cnn_accepts_3d_and_4d_input():
    model = cnn(width=8)
    assert model(torch.rand(4, 8, 8)).shape == (4, 10)
    assert model(torch.rand(4, 1, 28, 28)).shape == (4, 10)
    assert cnn(in_channels=3, classes=5, width=4)(torch.rand(2, 3, 16, 16)).shape == (2, 5)


def small_lm() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(vocab=50, d_model=32, n_layers=2, n_heads=4, max_len=16)


def test_lm_shapes_and_loss():
    model = small_lm()
    tokens = torch.randint(0, 50, (3, 10))
    logits = model(tokens)
    assert logits.shape == (3, 10, 50) and logits.dtype == torch.float32
    loss = lm_loss(logits, tokens)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    # At initialisation the prediction is close to uniform: loss ~ log(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(50.0)).item()) < 0.5


def test_lm_loss_is_float32_for_16_bit_logits():
    logits = torch.randn(2, 5, 50).to(torch.bfloat16)
    tokens = torch.randint(0, 50, (2, 5))
    assert lm_loss(logits, tokens).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_loss_equals_cross_entropy_of_the_shifted_logits(dtype):
    # Control: the slice-and-upcast formula, in float32, of the same logits.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 50, generator=g).to(dtype).requires_grad_()
    tokens = torch.randint(0, 50, (3, 9), generator=g)
    loss = lm_loss(logits, tokens)
    loss.backward()
    up = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(up[:, :-1].reshape(-1, 50), tokens[:, 1:].reshape(-1))
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    eps = torch.finfo(dtype).eps  # the gradient is rounded once to the logits' dtype
    torch.testing.assert_close(logits.grad.float(), up.grad, rtol=eps, atol=1e-7)
    assert logits.grad.dtype == dtype and (logits.grad[:, -1] == 0).all()


def test_lm_is_causal():
    model = small_lm().eval()
    tokens = torch.randint(0, 50, (2, 12))
    t = 5
    changed = tokens.clone()
    changed[:, t + 1] = (changed[:, t + 1] + 1) % 50
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=0)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_lm_sequence_too_long():
    with pytest.raises(ValueError, match=r"sequence length 17 exceeds max_len=16"):
        small_lm()(torch.zeros(1, 17, dtype=torch.int64))


def test_lm_heads_must_divide_width():
    with pytest.raises(ValueError, match=r"d_model=30 is not divisible by n_heads=4"):
        CausalLM(d_model=30, n_heads=4)


def test_speech_shapes_and_lengths():
    model = SpeechCTC(n_mels=12, n_tokens=7, hidden=16)
    out = model(torch.randn(3, 41, 12))
    assert out.shape == (21, 3, 7) and out.dtype == torch.float32
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(21, 3))  # log-probs
    lengths = torch.tensor([41, 40, 1, 0])
    assert model.output_lengths(lengths).tolist() == [21, 20, 1, 0]
    with pytest.raises(ValueError, match=r"features must be \(batch, time, n_mels=12\)"):
        model(torch.randn(3, 41, 13))


def test_synthetic_speech():
    feats, targets, in_len, tgt_len = synthetic_speech(n=16, time=60, n_mels=12, n_tokens=7)
    assert feats.shape == (16, 60, 12) and feats.dtype == torch.float32
    assert targets.shape == (16, 15) and targets.dtype == torch.int64
    assert ((tgt_len >= 5) & (tgt_len <= 15)).all() and (in_len <= 60).all()
    for i in range(16):
        seq = targets[i, : tgt_len[i]]
        assert ((seq >= 1) & (seq < 7)).all()  # no blank inside a target
        assert (seq[1:] != seq[:-1]).all()
        assert (targets[i, tgt_len[i] :] == 0).all()
        assert (feats[i, in_len[i] :] == 0).all()
    again = synthetic_speech(n=16, time=60, n_mels=12, n_tokens=7)
    assert all(
        torch.equal(a, b) for a, b in zip(again, (feats, targets, in_len, tgt_len), strict=True)
    )


def test_speech_ctc_trains():
    feats, targets, in_len, tgt_len = synthetic_speech(n=32, time=60, n_mels=16, n_tokens=8)
    torch.manual_seed(0)
    model = SpeechCTC(n_mels=16, n_tokens=8, hidden=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out_len = model.output_lengths(in_len)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = ctc_loss(model(feats), targets, out_len, tgt_len)
        assert loss.dtype == torch.float32
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]


def test_ctc_loss_casts_16_bit_log_probs():
    log_probs = torch.randn(10, 2, 5).log_softmax(-1).to(torch.bfloat16)
    loss = ctc_loss(log_probs, torch.tensor([[1, 2], [3, 4]]), torch.tensor([10, 8]),
                    torch.tensor([2, 2]))  # fmt: skip
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_recommender_shapes_and_sparse_grads():
    torch.manual_seed(0)
    model = Recommender(table_sizes=(20, 30, 5), dim=4, hidden=8)
    ids = torch.stack([torch.randint(0, s, (6,)) for s in (20, 30, 5)], dim=1)
    logits = model(ids)
    assert logits.shape == (6,)
    logits.sum().backward()
    assert all(t.weight.grad.is_sparse for t in model.tables)
    assert not any(p.grad.is_sparse for p in model.mlp.parameters())
    dense = Recommender(table_sizes=(20,), dim=4, sparse=False)
    dense(torch.zeros(2, 1, dtype=torch.int64)).sum().backward()
    assert not dense.tables[0].weight.grad.is_sparse


def test_recommender_wrong_number_of_columns():
    with pytest.raises(ValueError, match=r"ids must be \(batch, 3\).*got shape \(4, 2\)"):
        Recommender()(torch.zeros(4, 2, dtype=torch.int64))


@pytest.mark.parametrize(
    ("name", "kwargs", "x", "shape"),
    [
        ("mlp", {"input_shape": 64, "hidden": 16}, torch.rand(2, 8, 8), (2, 10)),
        ("cnn", {"width": 4}, torch.rand(2, 8, 8), (2, 10)),
        ("lm", {"vocab": 20, "d_model": 16, "max_len": 8}, torch.zeros(2, 8).long(), (2, 8, 20)),
        ("speech", {"n_mels": 8, "hidden": 8}, torch.randn(2, 10, 8), (5, 2, 29)),
        ("recommender", {"table_sizes": (5, 5)}, torch.zeros(3, 2, dtype=torch.int64), (3,)),
    ],
)  # fmt: skip
def test_get_model_builds_each(name, kwargs, x, shape):
    model = get_model(name, **kwargs)
    assert isinstance(model, torch.nn.Module)
    assert model(x).shape == shape
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_registry_names():
    assert set(MODELS) == {"mlp", "cnn", "lm", "speech", "recommender"}


def test_get_model_unknown_name():
    with pytest.raises(ValueError) as info:
        get_model("reccomender")
    message = str(info.value)
    assert "'reccomender'" in message
    assert "valid names: mlp, cnn, lm, speech, recommender" in message
    assert "closest: 'recommender'" in message


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: mlp(classes=0), r"classes=0 is invalid; it must be an int >= 1"),
        (lambda: mlp(hidden=2.5), r"hidden=2\.5 is invalid"),
        (lambda: mlp(input_shape=(28, 28.0)), r"input_shape=\(28, 28\.0\) is invalid"),
        (lambda: cnn(width=0), r"width=0 is invalid"),
        (lambda: CausalLM(n_heads=0), r"n_heads=0 is invalid; it must be an int >= 1"),
        (lambda: CausalLM(max_len=0), r"max_len=0 is invalid"),
        (lambda: synthetic_speech(n=2.0), r"n=2\.0 is invalid"),
        # Sizes that built models unable to learn (no embedding, constant outputs).
        (lambda: Recommender(dim=0), r"dim=0 is invalid"),
        (lambda: Recommender(hidden=0), r"hidden=0 is invalid"),
        (lambda: Recommender(table_sizes=(0, 5)), r"table_sizes entry=0 is invalid"),
        (lambda: SpeechCTC(n_tokens=1), r"n_tokens=1 is invalid; it must be an int >= 2"),
        (lambda: SpeechCTC(n_mels=0), r"n_mels=0 is invalid"),
    ],
)
def test_sizes_are_checked_and_named(build, message):
    from mixprec import ArgumentError

    with pytest.raises(ArgumentError, match=message):
        build()


def test_synthetic_speech_refuses_a_time_whose_frames_cannot_hold_its_targets():
    """time=30 passed the old check, and 8 of 64 samples had 11 frames for up to 15
    targets after the stride-2 convolution: an infinite CTC loss."""
    from mixprec import ArgumentError

    with pytest.raises(ArgumentError, match=r"time=38 is invalid; it must be an int >= 39"):
        synthetic_speech(time=38)
    feats, targets, in_len, tgt_len = synthetic_speech(n=256, time=39, n_mels=12, n_tokens=7)
    model = SpeechCTC(n_mels=12, n_tokens=7)
    frames = model.output_lengths(in_len)
    assert bool((frames >= tgt_len).all())
    assert torch.isfinite(ctc_loss(model(feats), targets, frames, tgt_len))


def test_ctc_loss_refuses_labels_its_log_probs_cannot_hold():
    # torch's CPU kernel read past the log-probs: a label of 1000 gave -3.2e30, the blank as
    # a label a loss like any other.
    log_probs = torch.randn(10, 2, 5).log_softmax(-1)
    lengths, target_lengths = torch.tensor([10, 8]), torch.tensor([2, 2])
    for bad, value in (([[1, 2], [3, 9]], 9), ([[1, 0], [3, 4]], 0), ([[1, -2], [3, 4]], -2)):
        with pytest.raises(ArgumentError, match=rf"targets hold the label {value}; valid: 0\.\.4"):
            ctc_loss(log_probs, torch.tensor(bad), lengths, target_lengths)
    # Past a sample's length the row is padding: not looked at.
    padded = torch.tensor([[1, 2, 99], [3, 4, 99]])
    assert torch.isfinite(ctc_loss(log_probs, padded, lengths, target_lengths))
    # Lengths as lists or tuples and concatenated 1-D targets, as torch takes them.
    expected = F.ctc_loss(log_probs, padded, lengths, target_lengths)
    assert torch.equal(ctc_loss(log_probs, padded, [10, 8], (2, 2)), expected)
    flat = torch.tensor([1, 2, 3, 4])
    assert torch.equal(ctc_loss(log_probs, flat, (10, 8), (2, 2)), expected)
    with pytest.raises(ArgumentError, match=r"targets hold the label 7"):
        ctc_loss(log_probs, torch.tensor([1, 2, 3, 7]), (10, 8), (2, 2))
