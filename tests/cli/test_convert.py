"""``mixprec convert``: non-finite values and ``--on-range``."""

from __future__ import annotations

from mixprec import cli


def test_convert_refuses_nan_by_default_and_lists_it_when_ignored(tmp_path, capsys):
    import torch

    import mixprec as mp
    from tests.conftest import make_mlp

    model = make_mlp()
    with torch.no_grad():
        model[0].weight[0, :3] = torch.tensor([float("nan"), float("inf"), 1.0])
    ckpt = mp.save_checkpoint(tmp_path / "c.safetensors", model)
    out = tmp_path / "half.safetensors"
    assert cli.main(["convert", str(ckpt), str(out), "--dtype", "bfloat16"]) == 2
    assert "'0.weight' (1 NaN, 1 inf)" in capsys.readouterr().err and not out.exists()
    argv = ["convert", str(ckpt), str(out), "--dtype", "bfloat16", "--on-range", "ignore"]
    assert cli.main(argv) == 0
    assert "  0.weight: 1 NaN, 1 inf (kept: --on-range ignore)" in capsys.readouterr().out
