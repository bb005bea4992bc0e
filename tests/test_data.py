"""Datasets: the bundled digits, MNIST IDX parsing (on files written here, valid and each kind
of malformed), the synthetic generators, and the checks run before training."""

from __future__ import annotations

import gzip
import struct
import sys
from pathlib import Path

import pytest
import torch

from mixprec import ArgumentError
from mixprec.data import (
    check_finite,
    load_digits,
    load_mnist,
    synthetic_classification,
    synthetic_tokens,
    validate_classification,
)

# ---------------------------------------------------------------- digits


def test_digits_shapes_dtypes_ranges_and_split():
    (x_tr, y_tr), (x_te, y_te) = load_digits()
    assert x_tr.shape[1:] == x_te.shape[1:] == (8, 8)
    assert len(x_tr) + len(x_te) == 1797
    assert len(x_te) == round(1797 * 0.2)
    assert (len(y_tr), len(y_te)) == (len(x_tr), len(x_te))
    assert x_tr.dtype == x_te.dtype == torch.float32
    assert y_tr.dtype == y_te.dtype == torch.int64
    x = torch.cat([x_tr, x_te])
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0  # 16/16
    assert set(torch.cat([y_tr, y_te]).tolist()) == set(range(10))


def test_digits_deterministic_and_seeded():
    (a, ya), _ = load_digits(seed=3)
    (b, yb), _ = load_digits(seed=3)
    (c, _), _ = load_digits(seed=4)
    assert torch.equal(a, b) and torch.equal(ya, yb)
    assert not torch.equal(a, c)
    _, (x_te, _) = load_digits(test_fraction=0.5)
    assert len(x_te) == round(1797 * 0.5)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_digits_bad_fraction(fraction):
    with pytest.raises(ValueError, match=r"test_fraction=.* must be in \(0, 1\)"):
        load_digits(test_fraction=fraction)


# ---------------------------------------------------------------- MNIST IDX files

ROWS, COLS = 5, 7
NAMES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


def idx_bytes(values: torch.Tensor, magic: int | None = None) -> bytes:
    dims = list(values.shape)
    if magic is None:
        magic = 0x0800 | len(dims)
    header = struct.pack(">I", magic) + struct.pack(f">{len(dims)}I", *dims)
    return header + values.to(torch.uint8).numpy().tobytes()


def tiny_mnist():
    g = torch.Generator().manual_seed(0)
    return {
        "train_x": torch.randint(0, 256, (6, ROWS, COLS), generator=g),
        "train_y": torch.tensor([0, 1, 2, 3, 4, 9]),
        "test_x": torch.randint(0, 256, (4, ROWS, COLS), generator=g),
        "test_y": torch.tensor([5, 6, 7, 8]),
    }


def write(directory: Path, key: str, data: bytes, gz: bool) -> Path:
    path = directory / (NAMES[key] + (".gz" if gz else ""))
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def write_all(directory: Path, arrays=None, gz: bool = False) -> None:
    for key, values in (arrays or tiny_mnist()).items():
        write(directory, key, idx_bytes(values), gz)


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_reads_raw_and_gzipped(tmp_path, gz):
    arrays = tiny_mnist()
    write_all(tmp_path, arrays, gz)
    (x_tr, y_tr), (x_te, y_te) = load_mnist(tmp_path)
    assert x_tr.shape == (6, ROWS, COLS) and x_te.shape == (4, ROWS, COLS)
    assert x_tr.dtype == torch.float32 and y_tr.dtype == torch.int64
    torch.testing.assert_close(x_tr, arrays["train_x"].float() / 255, rtol=0, atol=0)
    torch.testing.assert_close(x_te, arrays["test_x"].float() / 255, rtol=0, atol=0)
    assert y_tr.tolist() == arrays["train_y"].tolist()
    assert y_te.tolist() == arrays["test_y"].tolist()


def test_mnist_mixed_raw_and_gzipped(tmp_path):
    arrays = tiny_mnist()
    for i, (key, values) in enumerate(arrays.items()):
        write(tmp_path, key, idx_bytes(values), gz=bool(i % 2))
    (x_tr, _), _ = load_mnist(str(tmp_path))
    assert x_tr.shape == (6, ROWS, COLS)


def corrupt(tmp_path: Path, key: str, data: bytes, gz: bool = False) -> None:
    write_all(tmp_path)
    (tmp_path / NAMES[key]).unlink()
    write(tmp_path, key, data, gz)


def test_mnist_bad_magic(tmp_path):
    labels = tiny_mnist()["train_y"]
    # Labels where images belong: a valid IDX file with the wrong magic number.
    corrupt(tmp_path, "train_x", idx_bytes(labels), gz=True)
    with pytest.raises(ValueError) as info:
        load_mnist(tmp_path)
    assert str(info.value) == (
        "train-images-idx3-ubyte.gz: magic number 2049, expected 2051 (images)"
    )


def test_mnist_wrong_dtype_code(tmp_path):
    data = bytearray(idx_bytes(tiny_mnist()["test_y"]))
    data[2] = 0x0D  # float32
    corrupt(tmp_path, "test_y", bytes(data))
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte: dtype code 0x0d, expected 0x08"):
        load_mnist(tmp_path)


def test_mnist_not_idx(tmp_path):
    corrupt(tmp_path, "train_y", b"\x1f\x8bnot idx at all")
    with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte: not an IDX file"):
        load_mnist(tmp_path)


def test_mnist_truncated_payload(tmp_path):
    data = idx_bytes(tiny_mnist()["train_x"])[:-3]
    corrupt(tmp_path, "train_x", data)
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte: truncated: payload is 207"):
        load_mnist(tmp_path)


def test_mnist_trailing_bytes(tmp_path):
    data = idx_bytes(tiny_mnist()["test_x"]) + b"\x00"
    corrupt(tmp_path, "test_x", data, gz=True)
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte.gz: trailing bytes"):
        load_mnist(tmp_path)


def test_mnist_truncated_gzip_stream(tmp_path):
    write_all(tmp_path)
    (tmp_path / NAMES["train_x"]).unlink()
    path = tmp_path / (NAMES["train_x"] + ".gz")
    path.write_bytes(gzip.compress(idx_bytes(tiny_mnist()["train_x"]))[:-10])
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: not a valid gzip file"):
        load_mnist(tmp_path)


def test_mnist_count_mismatch(tmp_path):
    corrupt(tmp_path, "train_y", idx_bytes(torch.tensor([0, 1, 2, 3, 4])))
    with pytest.raises(ValueError, match=r"has 6 images but train-labels-idx1-ubyte has 5 labels"):
        load_mnist(tmp_path)


def test_mnist_label_out_of_range(tmp_path):
    corrupt(tmp_path, "test_y", idx_bytes(torch.tensor([5, 6, 12, 8])))
    with pytest.raises(ValueError, match=r"label 12 at index 2 is out of range 0-9"):
        load_mnist(tmp_path)


def test_mnist_missing_file(tmp_path):
    write_all(tmp_path)
    (tmp_path / NAMES["test_x"]).unlink()
    with pytest.raises(FileNotFoundError) as info:
        load_mnist(tmp_path)
    assert "t10k-images-idx3-ubyte and t10k-images-idx3-ubyte.gz" in str(info.value)


def test_mnist_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_mnist(tmp_path / "nowhere")


# ---------------------------------------------------------------- synthetic


def test_synthetic_classification_shapes_and_determinism():
    x, y = synthetic_classification(n=100, features=8, classes=3, seed=5)
    assert x.shape == (100, 8) and x.dtype == torch.float32
    assert y.shape == (100,) and y.dtype == torch.int64
    assert int(y.min()) >= 0 and int(y.max()) < 3
    x2, y2 = synthetic_classification(n=100, features=8, classes=3, seed=5)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, synthetic_classification(n=100, features=8, classes=3, seed=6)[0])


def test_synthetic_classification_is_learnable():
    x, y = synthetic_classification(n=2048)
    x_tr, y_tr, x_te, y_te = x[:1536], y[:1536], x[1536:], y[1536:]
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 10)  # the teacher is linear: logistic regression suffices
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x_tr), y_tr).backward()
        opt.step()
    accuracy = (model(x_te).argmax(1) == y_te).float().mean().item()
    assert accuracy > 0.8


def test_synthetic_classification_bad_args():
    with pytest.raises(ValueError, match=r"classes=1 is invalid"):
        synthetic_classification(classes=1)


def test_synthetic_tokens_shapes_determinism_and_structure():
    tokens = synthetic_tokens(n=32, seq_len=20, vocab=50, seed=1)
    assert tokens.shape == (32, 20) and tokens.dtype == torch.int64
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 50
    assert torch.equal(tokens, synthetic_tokens(n=32, seq_len=20, vocab=50, seed=1))
    assert not torch.equal(tokens, synthetic_tokens(n=32, seq_len=20, vocab=50, seed=2))
    # Learnable: each token is followed by at most 4 distinct tokens (the chain's branching).
    big = synthetic_tokens(n=256, seq_len=64, vocab=50)
    pairs = torch.stack([big[:, :-1].reshape(-1), big[:, 1:].reshape(-1)], 1).unique(dim=0)
    assert int(torch.bincount(pairs[:, 0]).max()) <= 4


# ---------------------------------------------------------------- validate_classification


def test_validate_accepts_good_data():
    x, y = synthetic_classification(n=10)
    validate_classification(x, y, num_classes=10)
    validate_classification(x, y)
    validate_classification(torch.zeros(3, 2, dtype=torch.int64), torch.tensor([0, 1, 2]))


def test_validate_empty():
    with pytest.raises(ValueError, match=r"^data is empty: 0 samples$"):
        validate_classification(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64))


def test_validate_length_mismatch():
    with pytest.raises(ValueError, match=r"train: x has 5 samples but y has 4 labels"):
        validate_classification(torch.zeros(5, 2), torch.zeros(4, dtype=torch.int64), name="train")


def test_validate_nan_and_inf():
    x = torch.zeros(6, 3)
    x[2, 1] = float("nan")
    x[4, 0] = float("inf")
    with pytest.raises(ValueError, match=r"x has 2 non-finite value\(s\).*first is in sample 2"):
        validate_classification(x, torch.zeros(6, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_values_whose_sum_overflows_pass(dtype):
    # The check sums first (one read); a sum that overflows on finite values (two near the
    # dtype's largest, or float16 past 65504) is not a NaN/inf in the data.
    big = torch.finfo(dtype).max
    x = torch.full((4, 2), big, dtype=dtype)
    validate_classification(x, torch.zeros(4, dtype=torch.int64))
    x[3, 1] = float("-inf")
    with pytest.raises(ValueError, match=r"x has 1 non-finite value\(s\).*first is in sample 3"):
        validate_classification(x, torch.zeros(4, dtype=torch.int64))


def test_validate_float_labels():
    with pytest.raises(ValueError, match=r"labels must have an integer dtype, got torch.float32"):
        validate_classification(torch.zeros(3, 2), torch.tensor([0.0, 1.0, 2.0]))


def test_validate_label_out_of_range():
    y = torch.tensor([0, 3, 10, 2])
    with pytest.raises(ValueError, match=r"label 10 at sample 2 is out of range.* 0\.\.9"):
        validate_classification(torch.zeros(4, 2), y, num_classes=10)
    validate_classification(torch.zeros(4, 2), y)  # no num_classes: only >= 0 is checked
    with pytest.raises(ValueError, match=r"label -1 at sample 1 is out of range.*>= 0"):
        validate_classification(torch.zeros(2, 2), torch.tensor([0, -1]))


def test_digits_without_sklearn(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"a mixprec dependency .*: pip install scikit-learn"):
        load_digits()


def test_mnist_with_no_images_names_the_file(tmp_path):
    arrays = tiny_mnist()
    arrays["train_x"], arrays["train_y"] = arrays["train_x"][:0], arrays["train_y"][:0]
    write_all(tmp_path, arrays)
    with pytest.raises(
        ValueError, match=r"train-images-idx3-ubyte: dims \[0, 5, 7\] hold no images"
    ):
        load_mnist(tmp_path)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: synthetic_classification(n=10.5), r"n=10\.5 is invalid; it must be an int >= 1"),
        (lambda: synthetic_classification(classes=True), r"classes=True is invalid"),
        (lambda: synthetic_tokens(seq_len=3.0), r"seq_len=3\.0 is invalid; it must be an int >= 1"),
        (
            lambda: validate_classification(torch.zeros(4, 2), torch.tensor([0, 1, 2, 1]), 2.5),
            r"num_classes=2\.5 is invalid; it must be an int >= 1",
        ),
    ],
)
def test_sizes_that_are_not_ints_are_named(call, message):
    with pytest.raises(ArgumentError, match=message):
        call()


def test_a_scalar_is_checked_for_finiteness_as_one_sample():
    check_finite(torch.tensor(1.0), "x")
    with pytest.raises(ValueError, match=r"x has 1 non-finite value\(s\).*sample 0"):
        check_finite(torch.tensor(float("nan")), "x")


def test_mnist_splits_of_two_image_sizes_are_refused(tmp_path):
    # A 32x32 t10k beside a 28x28 train set loaded, to fail later as a shape error.
    arrays = tiny_mnist()
    arrays["test_x"] = torch.zeros(4, ROWS + 2, COLS, dtype=torch.uint8)
    write_all(tmp_path, arrays)
    with pytest.raises(ValueError, match=r"the train images are .* and the t10k images .*; both"):
        load_mnist(tmp_path)


def test_label_positions_are_named_by_sample_and_ignore_index_must_be_an_int():
    x = torch.randn(3, 4)
    y = torch.tensor([[0, 1], [1, 0], [7, 0]])
    with pytest.raises(ValueError, match=r"label 7 at sample 2, position \(0,\) is out of range"):
        validate_classification(x, y, num_classes=3)
    with pytest.raises(ArgumentError, match=r"ignore_index=-100.0 is invalid; it must be an"):
        validate_classification(x, y % 3, num_classes=3, ignore_index=-100.0)
