"""``mixprec bench``: float8 modes, a CUDA device where there is none, progress, the
chart's subtitle and the help."""

from __future__ import annotations

import itertools

import pytest
import torch

from mixprec import cli
from tests.bench._fake_pool import fake_pool


def test_bench_float8_mode_says_what_it_converted_and_that_cpu_emulates_it(capsys):
    pytest.importorskip("torchao")
    # torchao's size thresholds convert none of the small MLP's layers: a fast float8 run.
    # --policy adds the policy's mode beside float32 and O2-bf16. On CPU (not auto's CUDA,
    # on a machine with a GPU): the note is about CPU emulation.
    assert cli.main(["bench", "mlp-b64", "--small", "--device", "cpu", "--policy", "mixed_float8",
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


@pytest.fixture
def fake_steps(monkeypatch):
    """Every mode's step is instant and takes 2 ms (float32) or 1 ms on a clock the test
    controls: a bench run costs nothing and prints the same figures every time."""
    import types

    import torch

    from mixprec.bench import runner

    now = [0.0]

    def build_step(mode, work, device, **kwargs):
        def step():
            now[0] += 0.002 if mode == "float32" else 0.001
            return torch.tensor(1.0)

        return step

    monkeypatch.setattr(runner, "build_step", build_step)
    monkeypatch.setattr(runner, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))


FAST = ["--small", "--no-memory", "--repeats", "2", "--steps", "1", "--warmup", "1",
        "--min-round-ms", "0"]  # fmt: skip


def test_bench_shows_progress_on_stderr_and_keeps_stdout_unchanged(fake_steps, monkeypatch,
                                                                   capsys):  # fmt: skip
    """Issue 33 item 9: bench printed nothing for minutes. A tqdm bar on stderr steps once
    per unit of work (each mode's warm-up and rounds, per workload) to its total; stdout
    holds the same tables as without the bar."""
    from tqdm import tqdm

    from mixprec import bench
    from mixprec.cli import bench as cli_bench

    argv = ["bench", "mlp-b64", "cnn", "--modes", "float32,O2-bf16", *FAST]
    real = cli_bench._progress_bar
    monkeypatch.setattr(cli_bench, "_progress_bar",
                        lambda total, unit: tqdm(total=total, disable=True))  # fmt: skip
    assert cli.main(argv) == 0
    quiet = capsys.readouterr()
    bars: list[tqdm] = []
    monkeypatch.setattr(cli_bench, "_progress_bar",
                        lambda total, unit: bars.append(real(total, unit)) or bars[-1])  # fmt: skip
    assert cli.main(argv) == 0
    shown = capsys.readouterr()
    assert shown.out == quiet.out and "workload cnn" in shown.out and "\r" not in shown.out
    (bar,) = bars
    total = 2 * bench.run_units(["float32", "O2-bf16"], repeats=2, memory=False)
    assert bar.total == bar.n == total == 14
    # The last unit: no mode buys little (O2-bf16 is 2x), so nothing to profile.
    assert f"{total}/{total}" in shown.err and "cnn no matmul profile needed]" in shown.err


def test_max_batch_shows_progress_per_mode_and_probe(monkeypatch, capsys):
    from mixprec import bench

    compile_modes = []

    def max_batch(workload, mode, budget, *args, progress=None, compile_mode=None):
        compile_modes.append(compile_mode)
        for batch, fits in ((1, True), (2, True), (4, False)):
            progress(batch, fits)
        return 2

    monkeypatch.setattr(bench, "max_batch", max_batch)
    argv = ["bench", "mlp-b64", "cnn", "--small", "--modes", "float32,O2-bf16", "--max-batch", "9"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "workload mlp-b64: largest batch within 9 MB",
        "  float32                      2 (1.00x float32)",
        "  O2-bf16                      2 (1.00x float32)",
        "workload cnn: largest batch within 9 MB",
        "  float32                      2 (1.00x float32)",
        "  O2-bf16                      2 (1.00x float32)",
    ]
    assert "4/4" in err and "cnn O2-bf16: batch 4 too big" in err


@pytest.mark.parametrize(
    ("modes", "message"),
    [
        ("", "--modes '' is empty; give comma-separated modes, each optionally '+compile', "
             "from: float32, torch-autocast-bf16, "),
        ("float32,,O2-bf16", "--modes 'float32,,O2-bf16' has an empty mode name; give "),
    ],
)  # fmt: skip
def test_bench_empty_modes_are_a_usage_error(modes, message, fake_steps, capsys):
    """Issue 32 item 10: ``--modes ""`` ran every mode."""
    from mixprec import bench

    assert cli.main(["bench", "mlp-b64", "--modes", modes, *FAST]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and message in err
    assert all(m in err for m in bench.ALL_MODES)


def test_bench_runs_a_repeated_mode_once_with_a_note(fake_steps, capsys):
    """Issue 32 item 10: duplicate modes printed duplicate rows. They are de-duplicated,
    in order, and a note on stderr says so."""
    argv = ["bench", "mlp-b64", "--modes", "O2-bf16,float32,O2-bf16, float32", *FAST]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("float32", "O2-"))]
    assert rows == ["O2-bf16", "float32"]  # in the order named
    assert "note: --modes names O2-bf16, float32 more than once; each mode runs once" in err
    # --compile adds each compiled mode once, beside one already named.
    assert cli.main(["bench", "mlp-b64", "--modes", "O2-bf16,O2-bf16+compile", "--compile",
                     *FAST]) == 0  # fmt: skip
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()
            if line.startswith(("float32", "O2-"))]  # fmt: skip
    assert rows == ["float32", "O2-bf16", "O2-bf16+compile"]


def not_a_workload() -> list[int]:
    return [1, 2]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("json:loads", "workload 'json:loads': json.loads cannot be called without arguments "
                       "(missing a required argument: 's'); give a function that takes no "
                       "arguments and returns a mixprec.bench.Workload"),
        ("tests.cli.test_bench:not_a_workload", "workload 'tests.cli.test_bench:not_a_workload':"
         " tests.cli.test_bench.not_a_workload() returned list, not a Workload; give a "
         "function that takes no arguments and returns a mixprec.bench.Workload"),
    ],
)  # fmt: skip
def test_bench_spec_that_is_no_workload_factory_is_one_line(spec, message, fake_steps, capsys):
    """Issue 32 item 13: ``mixprec bench json:loads`` ended in json's raw TypeError."""
    assert cli.main(["bench", spec, *FAST]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"mixprec bench: error: {message}\n"


def test_bench_unknown_compile_mode_lists_the_valid_ones_before_any_work(fake_steps, capsys):
    """Issue 32 item 13: ``--compile-mode bogus`` ran the bench, then failed in dynamo."""
    assert cli.main(["bench", "mlp-b64", "--compile", "--modes", "O2-bf16",
                     "--compile-mode", "bogus", *FAST]) == 2  # fmt: skip
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert "--compile-mode 'bogus' is not a torch.compile mode; valid: " in err
    for mode in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        assert f" {mode}," in err or err.rstrip().endswith(f" {mode}")


def test_bench_refuses_a_plot_suffix_matplotlib_cannot_write_before_any_work(
    fake_steps, tmp_path, capsys
):
    assert cli.main(["bench", "mlp-b64", "--plot", str(tmp_path / "b.bogus"), *FAST]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "matplotlib cannot write '.bogus' files; give a .png file path" in err


@pytest.mark.parametrize("fast", [True, False])
def test_bench_chart_subtitle_says_whether_bf16_is_fast(fast, fake_steps, monkeypatch, tmp_path,
                                                        capsys):  # fmt: skip
    """Issue 33 item 12: the subtitle named the CPU, not whether it has fast bf16. Issue 30
    item 5: it names the CPU shortly, its 16-bit units and torch's threads."""
    from mixprec import _hardware, bench

    flags = {"avx512_bf16"} if fast else {"avx2"}
    monkeypatch.setattr(_hardware, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(_hardware, "bf16_matmul_speedup", lambda: 4.5)  # as the EPYC measured
    monkeypatch.setattr(_hardware, "cpuinfo_field", lambda name: "AMD EPYC 9B14 96-Core Processor")
    figures = []

    def plot(results, path, subtitle=None):
        figures.append(bench.chart(results, subtitle))

    monkeypatch.setattr(bench, "plot", plot)
    argv = ["bench", "mlp-b64", "--modes", "float32,O2-bf16", "--device", "cpu",
            "--plot", str(tmp_path / "b.png"), *FAST]  # fmt: skip
    assert cli.main(argv) == 0
    (fig,) = figures
    subtitle = fig.axes[0].get_title().splitlines()[1]
    expected = ("fast bf16 (AVX512-BF16)" if fast else
                "no fast bf16 (no AVX512-BF16 or AMX: bfloat16 matmuls are emulated)")  # fmt: skip
    threads = torch.get_num_threads()
    assert subtitle == (f"AMD EPYC 9B14, {expected}, {threads} thread{'s' * (threads != 1)}, "
                        f"torch {torch.__version__}, --small shapes")  # fmt: skip
    # The rounds' spread reaches the chart: one whisker a mode beside float32.
    from matplotlib.container import ErrorbarContainer

    assert sum(isinstance(c, ErrorbarContainer) for c in fig.axes[0].containers) == 1


def test_bench_help_lists_modes_workloads_and_every_default(capsys):
    """Issue 33 item 8: ``bench --help`` showed no defaults or descriptions for --repeats,
    --steps, --warmup, and no mode names."""
    from mixprec import bench

    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal
    # Each option's entry runs to the next one's (in the order of the options).
    defaults = [("--repeats REPEATS", 5), ("--steps STEPS", 3), ("--min-round-ms MS", 100),
                ("--warmup WARMUP", 2), ("--device DEVICE", "auto"), ("--no-memory", None),
                ("--batch-limit N", 65536), ("--outputs-16bit", None)]  # fmt: skip
    for (option, default), (after, _) in itertools.pairwise(defaults):
        if default is None:
            continue
        start = out.index(option, out.index(" options: "))  # past the usage line
        described = out[start : out.index(after, start)]
        assert f"(default: {default}" in described, described
        assert len(described) > len(option) + 30, described  # it says what the option does
    lists = out[out.index("modes (--modes; each also as MODE+compile):") :]
    for mode in bench.ALL_MODES:
        assert f" {mode} {bench.MODE_HELP[mode].split()[0]}" in lists, mode
    assert "O2-fp8 float8 Linear layers" in lists and "[opt-in]" in lists
    for workload in bench.WORKLOADS:
        assert f" {workload} {bench.WORKLOAD_HELP[workload].split()[0]}" in lists, workload
    assert f"default: {' '.join(bench.DEFAULT_WORKLOADS)}" in lists
    assert f"module:function (default: {' '.join(bench.DEFAULT_WORKLOADS)})" in out


def test_max_batch_passes_the_compile_mode_and_refuses_json_and_plot(monkeypatch, tmp_path, capsys):
    """--max-batch probed every mode uncompiled whatever --compile-mode said, and returned
    before --json and --plot were written, with exit 0."""
    from mixprec import bench

    seen = []
    monkeypatch.setattr(bench, "max_batch", lambda *a, progress=None, compile_mode=None:
                        seen.append(compile_mode) or 1)  # fmt: skip
    argv = ["bench", "mlp-b64", "--small", "--modes", "O2-bf16", "--max-batch", "9",
            "--compile", "--compile-mode", "max-autotune-no-cudagraphs"]  # fmt: skip
    assert cli.main(argv) == 0
    assert set(seen) == {"max-autotune-no-cudagraphs"}
    for extra in (["--json", str(tmp_path / "m.json")], ["--plot", str(tmp_path / "m.png")]):
        assert cli.main([*argv, *extra]) == 2
        assert "--json and --plot write the timing run's results" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("device", ["mps", "xpu", "meta"])
def test_bench_refuses_a_device_it_cannot_measure(device, fake_steps, capsys):
    """`--device mps|xpu|meta` passed the check (CUDA only) and ended in a traceback."""
    assert cli.main(["bench", "mlp-b64", "--device", device, *FAST]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"mixprec bench: error: --device {device!r}: mixprec bench runs on CPU or CUDA only; "
        "valid: auto, cpu, cuda, cuda:N\n"
    )


def test_bench_refuses_a_cuda_index_past_the_last_gpu(monkeypatch, fake_steps, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cli.main(["bench", "mlp-b64", "--device", "cuda:1", *FAST]) == 2
    assert capsys.readouterr().err == (
        "mixprec bench: error: --device 'cuda:1': this machine has 1 CUDA device(s); valid: "
        "cuda:0 to cuda:0\n"
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--compile-mode", "max-autotune"],
         "--compile-mode max-autotune applies to compiled modes; give --compile, or "
         "MODE+compile in --modes"),
        (["--float8-min-features", "16"],
         "--float8-min-features 16 applies to float8 modes (O2-fp8, O2-fp8-rowwise, "
         "O2-fp8-rowwise_with_gw_hp); the modes to run (float32, O2-bf16) have none: give one "
         "in --modes, or --policy mixed_float8"),
        (["--batch-limit", "300"],
         "--batch-limit 300 caps the batches --max-batch tries; give --max-batch too, or leave "
         "--batch-limit out"),
    ],
)  # fmt: skip
def test_bench_refuses_an_option_that_does_not_apply(options, message, fake_steps, capsys):
    """Each was ignored: the bench ran as if it had not been given."""
    argv = ["bench", "mlp-b64", "--modes", "float32,O2-bf16", *options, *FAST]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"mixprec bench: error: {message}\n"


def test_bench_compile_mode_applies_to_modes_compiled_by_name(monkeypatch, capsys):
    """A MODE+compile in --modes is a compiled mode: --compile-mode applies without
    --compile."""
    from mixprec import bench

    seen = []
    monkeypatch.setattr(bench, "max_batch", lambda *a, progress=None, compile_mode=None:
                        seen.append(compile_mode) or 1)  # fmt: skip
    argv = ["bench", "mlp-b64", "--small", "--modes", "O2-bf16+compile", "--max-batch", "9",
            "--compile-mode", "max-autotune-no-cudagraphs"]  # fmt: skip
    assert cli.main(argv) == 0 and seen == ["max-autotune-no-cudagraphs"]


def test_max_batch_probes_the_limit_and_says_where_it_stopped(monkeypatch, capsys):
    """With --batch-limit 300 and every probe within the budget, 256 was printed as the
    largest batch within it, though 300 was never tried; and its ratio to float32 with it."""
    from mixprec import bench

    fake_pool(monkeypatch, 0.1)  # 300 samples: 30 MB, within 50
    probes: list[tuple[int, bool]] = []
    found = bench.max_batch("mlp-b64", "float32", 50, small=True, limit=300,
                            progress=lambda batch, fits: probes.append((batch, fits)))  # fmt: skip
    assert found == 300 and probes[-2:] == [(256, True), (300, True)]
    # Where the limit does not fit, the search bisects below it.
    fake_pool(monkeypatch, 0.18)  # 277 samples fit 50 MB, 278 do not
    assert 256 <= bench.max_batch("mlp-b64", "float32", 50, small=True, limit=300) < 278

    found_by_mode = {"float32": 300, "O2-bf16": 300, "O1-bf16": 150}
    monkeypatch.setattr(bench, "max_batch", lambda w, mode, *a, **k: found_by_mode[mode])
    argv = ["bench", "mlp-b64", "--small", "--modes", "float32,O2-bf16,O1-bf16",
            "--max-batch", "50", "--batch-limit", "300"]  # fmt: skip
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.splitlines() == [
        "workload mlp-b64: largest batch within 50 MB",
        "  float32                 >= 300 (reached --batch-limit)",
        "  O2-bf16                 >= 300 (reached --batch-limit)",
        "  O1-bf16                    150",  # no ratio against a float32 that reached the cap
    ]


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        (["--repeats", "9"], "--repeats"),
        (["--steps", "7", "--no-memory"], "--steps, --no-memory"),
        (["--warmup", "4", "--min-round-ms", "0"], "--min-round-ms, --warmup"),
    ],
)
def test_max_batch_refuses_the_timing_runs_options(options, shown, capsys):
    """--max-batch searched batch sizes and ignored --repeats, --steps, --warmup,
    --min-round-ms and --no-memory without a word."""
    argv = ["bench", "mlp-b64", "--small", "--modes", "float32", "--max-batch", "9", *options]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"mixprec bench: error: {shown} applies to the timing run; --max-batch searches batch "
        "sizes (one step per probe, in a fresh process): leave it out, or leave out "
        "--max-batch\n"
    )
