"""The benchmark's JSON and the notes on what the figures do not measure."""

from __future__ import annotations

import json

import torch

from mixprec import bench, cli
from mixprec._hardware import Hardware
from mixprec.bench import report


def test_outputs_16bit_from_the_command_line_are_recorded_in_the_json(tmp_path):
    out_json = tmp_path / "b.json"
    args = ["bench", "mlp-b64", "--small", "--modes", "float32,O2-bf16", "--outputs-16bit",
            "--no-memory", "--repeats", "1", "--steps", "1", "--warmup", "1",
            "--min-round-ms", "0", "--json", str(out_json)]  # fmt: skip
    assert cli.main(args) == 0
    assert json.loads(out_json.read_text())["outputs_16bit"] is True


def test_notes_say_what_the_figures_do_not_measure(monkeypatch):
    slow = Hardware("cpu", False, False, "CPU without AVX512-BF16 or AMX")
    monkeypatch.setattr(report, "probe_hardware", lambda: slow)
    notes = bench.notes(["float32", "O2-bf16", "O2-fp8+compile"], "cpu")
    assert len(notes) == 2
    assert notes[0].startswith("CPU without AVX512-BF16 or AMX: bfloat16 matmuls are emulated")
    assert notes[1].startswith("float8 on CPU is emulated")
    assert bench.notes(["float32", "O1-fp16"], "cpu") == [
        "CPU without AMX-FP16: float16 matmuls are emulated here, very slowly"
    ]
    fast = Hardware("cpu", True, False, "CPU with amx_bf16")
    monkeypatch.setattr(report, "probe_hardware", lambda: fast)
    assert bench.notes(["float32", "O2-bf16", "auto"], "cpu") == []
    only = bench.notes(["O2-fp8"], "cpu")  # fast bfloat16, but float8 is still emulated
    assert len(only) == 1 and only[0].startswith("float8 on CPU is emulated")
    # On CUDA: eager float8 is slow by design (torchao fuses its casts under compile).
    assert "fast under torch.compile only" in bench.notes(["O2-fp8", "O2-fp8+compile"], "cuda")[0]
    assert bench.notes(["O2-bf16+compile", "O2-fp8+compile"], "cuda") == []


def test_bf16_support_says_whether_and_why_bfloat16_is_fast_here(monkeypatch):
    """Issue 33 item 12: the chart named the CPU, not whether it has fast bf16, which
    decides the bf16 figures."""
    cases = [
        (Hardware("cpu", True, False, "CPU with amx_bf16, amx_tile, avx512_bf16"),
         "fast bf16 (AMX-BF16, AMX tiles, AVX512-BF16)"),
        (Hardware("cpu", True, False, "CPU with avx512_bf16"), "fast bf16 (AVX512-BF16)"),
        (Hardware("cpu", False, False, "CPU without AVX512-BF16 or AMX"),
         "no fast bf16 (no AVX512-BF16 or AMX: bfloat16 matmuls are emulated)"),
        (Hardware("cpu", True, False, "CPU (oneDNN bf16 support reported)"),
         "fast bf16 (oneDNN bf16 support reported)"),
    ]  # fmt: skip
    for hw, expected in cases:
        monkeypatch.setattr(report, "probe_hardware", lambda hw=hw: hw)
        assert bench.bf16_support("cpu") == expected
    # The CPU of a CUDA machine: its own flags, not the GPU's.
    monkeypatch.setattr(report, "probe_hardware",
                        lambda: Hardware("cuda", True, True, "CUDA H100 (sm_90)"))  # fmt: skip
    monkeypatch.setattr(report, "cpuinfo_field", lambda name: "fpu sse avx512_bf16")
    assert bench.bf16_support("cpu") == "fast bf16 (AVX512-BF16)"
    monkeypatch.setattr(report, "resolve_device", lambda device: torch.device("cuda"))
    assert bench.bf16_support("cuda") == "fast bf16 (sm_90)"


def test_the_json_records_bf16_support(monkeypatch):
    slow = Hardware("cpu", False, False, "CPU without AVX512-BF16 or AMX")
    monkeypatch.setattr(report, "probe_hardware", lambda: slow)
    data = json.loads(bench.to_json({}, device="cpu"))
    assert data["bf16"].startswith("no fast bf16")
