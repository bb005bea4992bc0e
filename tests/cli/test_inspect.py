"""``mixprec inspect`` on a checkpoint, and ``convert`` of the same checkpoint."""

from __future__ import annotations

import re

from mixprec import cli


def test_convert_and_inspect(tmp_path, capsys):
    import torch

    import mixprec as mp
    from tests.conftest import make_mlp

    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters()))
    ckpt = mp.save_checkpoint(tmp_path / "c.safetensors", model, opt, {"global_step": 7})
    assert cli.main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "policy: params=float32,compute=bfloat16,output=float32" in out
    assert "level: O2" in out and "trainer state: {'global_step': 7}" in out
    assert re.search(r"model/0\.weight\s+float32\s+\(64, 32\)", out)  # the float32 master
    half = tmp_path / "half.safetensors"
    assert cli.main(["convert", str(ckpt), str(half), "--dtype", "bfloat16"]) == 0
    assert "8 tensors in bfloat16 (8 converted from another dtype)" in capsys.readouterr().out
    same = tmp_path / "same.safetensors"
    assert cli.main(["convert", str(ckpt), str(same), "--dtype", "float32"]) == 0
    # The masters are float32: all 8 tensors are written, none of them converted.
    assert "8 tensors in float32 (0 converted from another dtype)" in capsys.readouterr().out
    tensors, _ = mp.read_checkpoint(half)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert sorted(tensors) == [f"model/{k}" for k in sorted(make_mlp().state_dict())]

    big = make_mlp()
    with torch.no_grad():
        big[0].weight[0, 0] = 1e6
    torch.save(big.state_dict(), tmp_path / "big.pt")
    assert cli.main(["convert", str(tmp_path / "big.pt"), str(tmp_path / "o.safetensors"),
                     "--dtype", "float16"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "mixprec convert: error:" in err and "'0.weight' has max |value| 1e+06" in err
    assert cli.main(["convert", str(tmp_path / "big.pt"), str(tmp_path / "o.safetensors"),
                     "--dtype", "float16", "--on-range", "clamp"]) == 0  # fmt: skip
    assert "exceeds float16 (clamp)" in capsys.readouterr().out
    assert cli.main(["inspect", str(tmp_path / "absent")]) == 2
    assert "no such checkpoint file" in capsys.readouterr().err


def test_inspect_shortens_nested_state_and_names_tied_weights(tmp_path, capsys):
    """Nested trainer state (every rank's RNG states) printed thousands of numbers, and a
    tied weight's second name, stored once, was left out as if missing."""
    from torch import nn

    import mixprec as mp
    from mixprec.checkpoint import rng_state

    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    state = {"global_step": 3, "rank_rng": [rng_state(), rng_state()]}
    ckpt = mp.save_checkpoint(tmp_path / "c.safetensors", model, trainer_state=state)
    assert cli.main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "model/1.weight is model/0.weight (tied, stored once)" in out
    line = next(x for x in out.splitlines() if x.startswith("  trainer state: "))
    assert "'torch': '<tensor uint8 (5056,)>'" in line and "'<625 items>'" in line
    assert len(line) < 1000
