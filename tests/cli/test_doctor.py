"""``mixprec doctor``."""

from __future__ import annotations

from mixprec import cli


def test_doctor_command(tmp_path, capsys):
    import json

    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    args = ["doctor", "--policy", "mixed_float16", "--batch-size", "64",
            "--json", str(out_json), "--plot", str(out_png)]  # fmt: skip
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "policy mixed_float16, level O2, loss scale 65536" in out
    assert "healthy: no module at risk in float16" in out
    assert json.loads(out_json.read_text())["culprits"] == []
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["doctor", "--policy", "fp8"]) == 2
    assert "unknown policy 'fp8'" in capsys.readouterr().err
