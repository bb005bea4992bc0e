"""``mixprec bench``: float8 modes and a CUDA device where there is none."""

from __future__ import annotations

import pytest

from mixprec import cli


def test_bench_float8_mode_says_what_it_converted_and_that_cpu_emulates_it(capsys):
    pytest.importorskip("torchao")
    # torchao's size thresholds convert none of the small MLP's layers: a fast float8 run.
    # --policy adds the policy's mode beside float32 and O2-bf16.
    assert cli.main(["bench", "mlp-b64", "--small", "--policy", "mixed_float8",
                     "--float8-min-features", "torchao", "--no-memory", "--repeats", "1",
                     "--steps", "1", "--min-round-ms", "0"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("float32 ", "O2-"))]
    assert rows[:3] == ["float32", "O2-bf16", "O2-fp8"]
    assert " fp8 " in out and " 0/3 " in out and "O2-fp8: " in out
    assert "fp8: Linear layers converted to float8 / Linear layers in the model " in out
    assert "(torchao's H100 size thresholds; the output head stays bfloat16)" in out
    assert "note: float8 on CPU is emulated" in out


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_bench_cuda_without_cuda_is_one_line(capsys):
    assert cli.main(["bench", "--small", "--device", "cuda"]) == 2
    assert "--device 'cuda': CUDA is not available" in capsys.readouterr().err
