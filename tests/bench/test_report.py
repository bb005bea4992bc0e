"""The benchmark's JSON and the notes on what the figures do not measure."""

from __future__ import annotations

import json

import pytest
import torch

from mixprec import _hardware, bench, cli
from mixprec._hardware import Hardware
from mixprec.bench import report


def test_outputs_16bit_from_the_command_line_are_recorded_in_the_json(tmp_path):
    out_json = tmp_path / "b.json"
    args = ["bench", "mlp-b64", "--small", "--modes", "float32,O2-bf16", "--outputs-16bit",
            "--no-memory", "--repeats", "1", "--steps", "1", "--warmup", "1",
            "--min-round-ms", "0", "--json", str(out_json)]  # fmt: skip
    assert cli.main(args) == 0
    assert json.loads(out_json.read_text())["outputs_16bit"] is True


def flags(monkeypatch, *names):
    """This CPU's flags, for ``_hardware``'s readers: ``names`` only; AVX512-BF16 without
    AMX with bfloat16 matmuls measured fast, as on an AMD EPYC."""
    monkeypatch.setattr(_hardware, "_cpu_flags", lambda: {"fpu", "sse2", *names})
    monkeypatch.setattr(_hardware, "bf16_matmul_speedup", lambda: 4.5)


def test_notes_say_what_the_figures_do_not_measure(monkeypatch):
    flags(monkeypatch, "avx2")
    notes = bench.notes(["float32", "O2-bf16", "O2-fp8+compile"], "cpu")
    assert len(notes) == 2
    assert notes[0].startswith("CPU without AVX512-BF16 or AMX: bfloat16 matmuls are emulated")
    assert notes[1].startswith("float8 on CPU is emulated")
    assert bench.notes(["float32", "O1-fp16"], "cpu") == [
        "CPU without AMX-FP16: float16 matmuls are emulated here, very slowly"
    ]
    flags(monkeypatch, "amx_bf16", "amx_tile")
    assert bench.notes(["float32", "O2-bf16", "auto"], "cpu") == []
    only = bench.notes(["O2-fp8"], "cpu")  # fast bfloat16, but float8 is still emulated
    assert len(only) == 1 and only[0].startswith("float8 on CPU is emulated")
    # On CUDA: eager float8 is slow by design (torchao fuses its casts under compile).
    assert "fast under torch.compile only" in bench.notes(["O2-fp8", "O2-fp8+compile"], "cuda")[0]
    assert bench.notes(["O2-bf16+compile", "O2-fp8+compile"], "cuda") == []


def test_bf16_support_says_whether_and_why_bfloat16_is_fast_here(monkeypatch):
    """Issue 33 item 12: the chart named the CPU, not whether it has fast bf16, which
    decides the bf16 figures."""
    slow = "no fast bf16 (no AVX512-BF16 or AMX: bfloat16 matmuls are emulated)"
    cases = [
        (("amx_bf16", "amx_tile", "avx512_bf16", "amx_fp16"), "fast bf16 (AMX-BF16, AVX512-BF16)"),
        (("avx512_bf16",), "fast bf16 (AVX512-BF16)"),
        (("avx2", "avx512f"), slow),
    ]  # fmt: skip
    for names, expected in cases:
        flags(monkeypatch, *names)
        assert bench.bf16_support("cpu") == expected
    # No flags to read (macOS, Windows): oneDNN's answer, as probe_hardware gives it.
    monkeypatch.setattr(_hardware, "_cpu_flags", set)
    onednn = Hardware("cpu", True, False, "CPU (oneDNN bf16 support reported)")
    monkeypatch.setattr(_hardware, "probe_hardware", lambda: onednn)
    # What cpu_fast asks: oneDNN's answer as stated, not this CPU's (no on AVX2 only).
    monkeypatch.setattr(_hardware, "probe_cpu", lambda: onednn)
    assert bench.bf16_support("cpu") == "fast bf16 (oneDNN bf16 support reported)"
    # The CPU of a CUDA machine: its own flags, not the GPU's.
    h100 = Hardware("cuda", True, True, "CUDA H100 (sm_90)")
    monkeypatch.setattr(report, "probe_hardware", lambda: h100)
    monkeypatch.setattr(_hardware, "probe_hardware", lambda: h100)
    flags(monkeypatch, "avx512_bf16")
    assert bench.bf16_support("cpu") == "fast bf16 (AVX512-BF16)"
    monkeypatch.setattr(report, "resolve_device", lambda device: torch.device("cuda"))
    assert bench.bf16_support("cuda") == "fast bf16 (sm_90)"


def test_the_device_is_named_with_its_16_bit_units_and_threads(monkeypatch):
    """Issue 30 item 5: the chart title and the JSON name the device and its 16-bit
    features ("Intel Xeon, AMX-BF16, 2 threads")."""
    monkeypatch.setattr(_hardware, "cpuinfo_field",
                        lambda name: "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz")  # fmt: skip
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    flags(monkeypatch, "amx_bf16", "amx_tile", "avx512_bf16", "amx_fp16")
    assert bench.device_description("cpu") == (
        "Intel Xeon Platinum 8481C, fast bf16 (AMX-BF16, AVX512-BF16), fast fp16 (AMX-FP16), "
        "2 threads"
    )
    flags(monkeypatch, "avx2")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert bench.device_description("cpu") == (
        "Intel Xeon Platinum 8481C, no fast bf16 (no AVX512-BF16 or AMX: bfloat16 matmuls are "
        "emulated), 1 thread"
    )
    data = json.loads(bench.to_json({}, device="cpu"))
    assert data["device_description"] == bench.device_description("cpu")
    assert data["threads"] == 1 and data["bf16"].startswith("no fast bf16")
    # The allocator, whose page faults the CPU figures include (bench.faults).
    from mixprec.bench.faults import allocator

    assert data["allocator"] == allocator()


@pytest.mark.parametrize(
    ("name", "short"),
    [
        ("Intel(R) Xeon(R) Processor", "Intel Xeon"),
        ("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "Intel Xeon Platinum 8481C"),
        ("AMD EPYC 9B14 96-Core Processor", "AMD EPYC 9B14"),
        ("Intel(R) Core(TM) i7-10700K CPU @ 3.80GHz", "Intel Core i7-10700K"),
        ("AMD EPYC 7B13", "AMD EPYC 7B13"),
        ("Apple M2", "Apple M2"),
    ],
)
def test_cpu_model_names_are_shortened_for_a_title(name, short):
    assert _hardware.cpu_model(name) == short


def test_the_committed_figures_load_and_a_json_reads_back(tmp_path):
    """The docs' JSON files, whatever fields they were written with, load as results the
    chart draws; a JSON written now reads back as it was."""
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    for path in sorted(docs.glob("bench_*.json")):
        results = bench.from_json(path.read_text())
        assert results and all(rs[0].mode == "float32" for rs in results.values()), path.name
        bench.chart(results)
    peer = "torch-autocast-bf16"
    r = bench.ModeResult("O2-bf16", "O2", 2.0, 500.0, 1.2, 0.5, None, autocast_peer=peer,
                         vs_autocast=0.95, no_gain="why", matmul_ms=0.5)  # fmt: skip
    assert bench.from_json(bench.to_json({"w": [r]}, device="cpu")) == {"w": [r]}


def test_a_compiled_mode_slower_than_its_eager_twin_is_said_to_be():
    # Issue 30: on the AMX CPU the compiled LM step was slower than the eager one for both
    # sides; the table says so rather than leave a user compiling by default.
    def result(mode: str, ms: float) -> bench.ModeResult:
        return bench.ModeResult(mode, "O2", ms, 1000 / ms, 1.0, 0.5, None)

    results = [result("float32", 10.0), result("auto-bf16", 4.0), result("auto-bf16+compile", 6.0),
               result("O1-bf16", 5.0), result("O1-bf16+compile", 5.1)]  # fmt: skip
    text = bench.table("lm-d512", results)
    lines = [line for line in text.splitlines() if "slower than eager" in line]
    assert lines == [
        "lm-d512 auto-bf16+compile: compiled is slower than eager here (6.00 vs 4.00 ms a step, "
        "0.67x): train this workload eagerly on this machine (compile=False)"
    ]  # O1's 2% is noise, not said
