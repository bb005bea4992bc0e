"""``--model`` and ``--data`` of ``train`` and ``doctor``: a user's ``module:function``
factory beside the built-in names, and one line (exit status 2) for each bad spec
(issue 33 item 10). The factories live in a module written to a temporary directory on
``sys.path``, as a user's would be on ``PYTHONPATH``."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest
import torch

from mixprec import cli
from mixprec.cli import _model_options as options
from mixprec.cli import train

M = "mixprec_user_factories"  # the user's module

SOURCE = """
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def digits_net():  # digits: 8x8 images, 10 classes
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(),
                         nn.Linear(32, 10))


class BlobNet(nn.Module):  # a class is a factory too
    def __init__(self, width=16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))

    def forward(self, x):
        return self.body(x)


def wide():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))


def three_classes():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 3))


def not_a_module():
    return 42


def needs_args(width):
    return nn.Linear(width, 10)


NOT_CALLABLE = 3


def blobs():  # (x, y): three separable blobs in 8 dims
    g = torch.Generator().manual_seed(0)
    y = torch.arange(300) % 3
    return torch.randn(300, 8, generator=g) + 4 * nn.functional.one_hot(y, 8).float(), y


def blobs_keras():  # Keras' load_data() form, as numpy: float64 x, int32 y
    x, y = blobs()
    x, y = x.double().numpy(), y.numpy().astype(np.int32)
    return (x[:240], y[:240]), (x[240:], y[240:])


def blobs_dataset():
    return TensorDataset(*blobs())


def blobs_loader():
    return DataLoader(TensorDataset(*blobs()), batch_size=32)


def float_labels():
    x, y = blobs()
    return x, y.float()


def three_things():
    x, y = blobs()
    return x, y, x


def raises():
    raise RuntimeError("boom")
"""

# Modules that fail as they are imported: not a missing module, a failing one.
BROKEN = {
    "mixprec_user_syntaxerr": "def f(:\n",
    "mixprec_user_raises_at_import": "raise RuntimeError('boom at import')\n",
}


@pytest.fixture(scope="module", autouse=True)
def user_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user")
    (folder / f"{M}.py").write_text(textwrap.dedent(SOURCE))
    for name, source in BROKEN.items():
        (folder / f"{name}.py").write_text(source)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        yield folder
    sys.modules.pop(M, None)


def test_doctor_takes_a_user_model_and_data(capsys):
    assert cli.main(["doctor", "--model", f"{M}:BlobNet", "--data", f"{M}:blobs",
                     "--batch-size", "64"]) == 0  # fmt: skip
    assert "policy mixed_float16, level O2" in capsys.readouterr().out
    assert cli.main(["doctor", "--model", f"{M}:digits_net", "--batch-size", "64"]) == 0
    assert "policy mixed_float16, level O2" in capsys.readouterr().out


def test_train_takes_a_user_model_and_keras_style_numpy_data(capsys):
    assert cli.main(["train", "--model", f"{M}:BlobNet", "--data", f"{M}:blobs_keras",
                     "--epochs", "3", "--batch-size", "32", "--lr", "0.01",
                     "--policy", "mixed_bfloat16", "--quiet", "--in-process"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    accuracy = dict(re.findall(r"^(\w+) \(O\d\)\s+([\d.]+)", out, re.MULTILINE))
    assert set(accuracy) == {"float32", "mixed_bfloat16"}, out
    assert all(float(a) >= 0.95 for a in accuracy.values()), accuracy


def test_the_worker_process_imports_the_users_module(monkeypatch, capsys):
    """Each run trains in a spawned worker, which finds the module on the same sys.path."""
    assert cli.main(["train", "--model", f"{M}:BlobNet", "--data", f"{M}:blobs",
                     "--epochs", "1", "--policy", "float32", "--compare", "none",
                     "--quiet"]) == 0  # fmt: skip
    assert re.search(r"^float32 \(O0\)\s+[\d.]+", capsys.readouterr().out, re.MULTILINE)


def test_tensors_numpy_and_a_dataset_give_the_same_splits():
    """(x, y) and a Dataset of the same samples split alike (the last 20% of a permutation
    from the seed); Keras' form is kept as given, float64 x as float32, int32 y as int64."""
    (x, y), (x_test, y_test) = options.load_data(f"{M}:blobs", seed=0)
    assert (len(x), len(x_test)) == (240, 60) and set(y_test.tolist()) == {0, 1, 2}
    (dx, dy), (dx_test, _) = options.load_data(f"{M}:blobs_dataset", seed=0)
    assert torch.equal(x, dx) and torch.equal(y, dy) and torch.equal(x_test, dx_test)
    (_, y1), _ = options.load_data(f"{M}:blobs", seed=1)
    assert not torch.equal(y, y1)  # another seed, another split
    (kx, ky), (kx_test, ky_test) = options.load_data(f"{M}:blobs_keras", seed=0)
    assert (kx.dtype, ky.dtype, len(kx), len(kx_test)) == (torch.float32, torch.int64, 240, 60)
    raw_x, raw_y = sys.modules[M].blobs()
    assert torch.equal(kx_test, raw_x[240:]) and torch.equal(ky_test, raw_y[240:])


def test_the_model_check_leaves_the_model_as_built():
    """The forward that checks a user's model runs in eval mode without gradients: its
    BatchNorm statistics stay as built and its modules keep their training mode."""
    x = torch.rand(10, 8, 8)
    model = options.build_model(f"{M}:digits_net", x, classes=10)
    assert model[1].in_features == 64  # the user's model
    norm = model[2]
    assert torch.equal(norm.running_mean, torch.zeros(32)) and int(norm.num_batches_tracked) == 0
    assert all(m.training for m in model.modules())


SPEC_ERRORS = [
    (["--model", f"{M}.digits_net"],
     f"unknown model '{M}.digits_net'; valid: mlp, cnn or module:function (did you mean "
     f"'{M}:digits_net'?)"),
    (["--model", "digits_net"], "unknown model 'digits_net'; valid: mlp, cnn, module:function"),
    (["--model", ":digits_net"], "--model ':digits_net': give module:function, a function that "
     "takes no arguments and returns a torch.nn.Module"),
    (["--model", "no_such_module_xyz:net"],
     "--model 'no_such_module_xyz:net': cannot import module 'no_such_module_xyz' (No module "
     "named 'no_such_module_xyz') (its directory must be on sys.path: PYTHONPATH=DIR); give a "
     "function that takes no arguments and returns a torch.nn.Module"),
    (["--model", f"{M}:missing"], f"--model '{M}:missing': module '{M}' has no function "
     "'missing'; give a function that takes no arguments"),
    (["--model", f"{M}:NOT_CALLABLE"], f"--model '{M}:NOT_CALLABLE': {M}.NOT_CALLABLE is not a "
     "function (it is a int); give a function"),
    (["--model", f"{M}:needs_args"], f"{M}.needs_args cannot be called without arguments "
     "(missing a required argument: 'width'); give a function that takes no arguments"),
    (["--model", f"{M}:not_a_module"], f"--model '{M}:not_a_module': {M}.not_a_module() "
     "returned int, not a torch.nn.Module; give a function"),
    (["--model", f"{M}:wide"], f"--model '{M}:wide' on --data 'digits' (a batch of shape "
     "(2, 8, 8)): its forward raised RuntimeError: mat1 and mat2 shapes cannot be multiplied "
     "(2x64 and 784x10)"),
    (["--model", f"{M}:BlobNet", "--data", "synthetic"], "its forward raised RuntimeError: "
     "mat1 and mat2 shapes cannot be multiplied"),
    (["--model", f"{M}:three_classes"], f"--model '{M}:three_classes' on --data 'digits' (a "
     "batch of shape (2, 8, 8)): the forward returned shape (2, 3); the loss is cross-entropy "
     "over the data's 10 classes, so give (2, 10) logits"),
    (["--data", f"{M}.blobs"], f"unknown data '{M}.blobs'; valid: digits, mnist:DIR, synthetic "
     f"or module:function (did you mean '{M}:blobs'?)"),
    (["--data", "no_such_module_xyz:blobs"], "--data 'no_such_module_xyz:blobs': cannot import "
     "module 'no_such_module_xyz'"),
    (["--data", f"{M}:blobs_loader"], f"--data '{M}:blobs_loader': {M}.blobs_loader() returned "
     "a DataLoader; return its Dataset (loader.dataset): --batch-size batches it"),
    (["--data", f"{M}:three_things"], f"--data '{M}:three_things': {M}.three_things() returned "
     "a tuple of 3; give a function that takes no arguments and returns (x, y), ((x_train, "
     "y_train), (x_test, y_test)) or a map-style torch Dataset of (x, y) samples"),
    (["--data", f"{M}:float_labels"], f"--data '{M}:float_labels': labels must have an integer "
     "dtype, got torch.float32"),
    (["--data", f"{M}:not_a_module"], f"{M}.not_a_module() returned int; give a function"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), SPEC_ERRORS)
def test_a_bad_spec_is_one_line_exit_2(argv, message, capsys):
    assert cli.main(["doctor", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("mixprec doctor: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [SPEC_ERRORS[4], SPEC_ERRORS[8], SPEC_ERRORS[13]],
    ids=["missing", "width", "loader"],
)
def test_train_refuses_a_bad_spec_before_any_run(argv, message, monkeypatch, capsys):
    """Checked in the main process: no worker starts, nothing trains."""

    def no_worker(config):
        raise AssertionError("a worker started")

    monkeypatch.setattr(train, "_in_subprocess", no_worker)
    assert cli.main(["train", "--quiet", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("mixprec train: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--lr", "0"], "--lr must be a finite number > 0, got 0"),
        (["train", "--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["train", "--lr", "-1"], "--lr must be a finite number > 0, got -1"),
        (["train", "--seed", str(2**70)], "--seed must be an int in [0, 2**63)"),
        (["bench", "mlp-b64", "--max-batch", "nan"], "--max-batch must be a memory budget"),
        (["bench", "mlp-b64", "--max-batch", "64", "--batch-limit", "0"],
         "--batch-limit must be >= 1, got 0"),
        (["bench", "mlp-b64", "--min-round-ms", "nan"], "--min-round-ms a finite number >= 0"),
    ],
)  # fmt: skip
def test_nonsense_numbers_are_one_line_exit_2(argv, message, monkeypatch, capsys):
    """They were accepted: --lr 0 trained nothing and --lr inf NaNs, both with exit 0."""
    monkeypatch.setattr(train, "_in_subprocess", lambda config: pytest.fail("a worker started"))
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"mixprec {argv[0]}: error: ") and message in err, err


MODEL_FACTORY = "give a function that takes no arguments and returns a torch.nn.Module"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "mixprec_user_syntaxerr:f"],
         r"--model 'mixprec_user_syntaxerr:f': cannot import module 'mixprec_user_syntaxerr' "
         r"\(SyntaxError: .*\(mixprec_user_syntaxerr\.py, line 1\)\); " + MODEL_FACTORY),
        (["--model", "mixprec_user_raises_at_import:f"],
         r"--model 'mixprec_user_raises_at_import:f': cannot import module "
         r"'mixprec_user_raises_at_import' \(RuntimeError: boom at import\); " + MODEL_FACTORY),
        (["--model", f"{M}:raises"],
         rf"--model '{M}:raises': {M}\.raises\(\) raised RuntimeError: boom"),
        (["--data", f"{M}:raises"],
         rf"--data '{M}:raises': {M}\.raises\(\) raised RuntimeError: boom"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("command", ["doctor", "train"])
def test_a_module_or_factory_that_fails_as_it_runs_is_one_line(command, argv, message, capsys):
    """Only ImportError was caught: a SyntaxError or any exception as the module imported,
    or one the factory raised, was a traceback and exit 1."""
    extra = ["--quiet"] if command == "train" else []  # checked before any worker starts
    assert cli.main([command, *argv, *extra]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert re.fullmatch(f"mixprec {command}: error: {message}\n", err), err


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("mixprec_user_syntaxerr:f",
         r"cannot import module 'mixprec_user_syntaxerr' \(SyntaxError: .*line 1\)\)"),
        (f"{M}:raises", rf"{M}\.raises\(\) raised RuntimeError: boom"),
    ],
)  # fmt: skip
def test_a_bench_workload_that_fails_as_it_runs_is_one_line(spec, message, capsys):
    assert cli.main(["bench", spec, "--small", "--no-memory"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert re.fullmatch(f"mixprec bench: error: workload '{spec}': {message}\n", err), err


def test_doctor_names_the_data_option_of_a_missing_mnist_directory(capsys):
    """The loader's keyword (`path='/nonexist' is not a directory ...`) was the message."""
    assert cli.main(["doctor", "--batch-size", "16", "--data", "mnist:/nonexist"]) == 2
    assert capsys.readouterr().err == (
        "mixprec doctor: error: --data 'mnist:/nonexist': '/nonexist' is not a directory; give "
        "mnist:DIR, DIR holding MNIST's IDX files\n"
    )
