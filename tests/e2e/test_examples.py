"""The workflow examples run, train, and show what they claim (small arguments, CPU)."""

from __future__ import annotations

import importlib.util
import itertools
import math
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest
import torch.distributed as dist

import mixprec as mp
from tests.conftest import ROOT, subprocess_env

pytest.importorskip("sklearn")

EXAMPLES = ROOT / "examples"


def run_example(name: str, argv: list[str]) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(argv)
    assert isinstance(result, dict)
    return result


def sane_scale(scale: float) -> bool:
    return math.isfinite(scale) and scale > 0


def test_keras_style(capsys: pytest.CaptureFixture[str]) -> None:
    mp.set_global_policy("mixed_float16")
    result = run_example("keras_style", ["--epochs", "3", "--hidden", "128", "--verbose", "0"])
    assert mp.global_policy().name == "mixed_float16"  # the example restores the global policy
    out = capsys.readouterr().out
    assert "Test accuracy" in out and "x its speed per step" in out
    for run in (result["float32"], result["mixed"]):
        assert run["loss"][-1] < run["loss"][0]
        assert 0.8 <= run["test_accuracy"] <= 1.0  # chance is 0.1
        assert run["ms_per_step"] > 0 and len(run["ms_per_step_by_epoch"]) == 3
        assert run["output_dtype"] == "float32"  # the float32 softmax output
    assert result["mixed"]["logits_dtype"] == "bfloat16"  # the layers before it are 16-bit
    assert abs(result["accuracy_diff"]) <= 0.03
    assert result["speedup"] > 0


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_tf_custom_loop(level: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_example("tf_custom_loop", ["--epochs", "2", "--samples", "2048", "--level", level])
    digits, rec = result["digits"], result["recommender"]
    assert digits["losses"][-1] < digits["losses"][0]
    assert 0.5 <= digits["test_accuracy"] <= 1.0
    # init scale 2**24 overflows float16 at first: steps were skipped and the scale backed off.
    assert digits["skipped_steps"] > 0 and sane_scale(digits["loss_scale"])
    assert digits["loss_scale"] < 2**24
    # get_scaled_loss / get_unscaled_gradients / apply_gradients == backward + step, exactly.
    assert digits["max_weight_diff"] == 0.0
    assert digits["one_call"]["skipped_steps"] == digits["skipped_steps"]

    assert rec["losses"][-1] < rec["losses"][0]
    assert 0.6 <= rec["test_accuracy"] <= 1.0
    assert rec["sparse_gradients"] and sane_scale(rec["loss_scale"])
    sparse_adam_steps, adam_steps = rec["optimizer_steps"]
    assert sparse_adam_steps == adam_steps > 0  # one apply_gradients stepped both
    assert "steps taken by SparseAdam" in capsys.readouterr().out


def test_torch_amp_style() -> None:
    result = run_example("torch_amp_style", ["--epochs", "2"])
    assert result["bitwise_identical"] and result["same_scales"]
    for name in ("torch.amp.GradScaler", "mp.GradScaler", "auto_mixed_precision"):
        run = result[name]
        assert run["losses"][-1] < run["losses"][0]
        assert 0.5 <= run["test_accuracy"] <= 1.0
        assert run["skipped_steps"] > 0 and sane_scale(run["final_scale"])
    ours, theirs = result["mp.GradScaler"], result["torch.amp.GradScaler"]
    assert ours["skipped_steps"] == theirs["skipped_steps"]


def test_mindspore_style(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_example("mindspore_style", ["--epochs", "2"])
    out = capsys.readouterr().out
    assert "epoch: 1 step: 20, loss is " in out  # LossMonitor's lines
    manual, built, trained = result["manual"], result["build_train_step"], result["trainer"]
    for run in (manual, built, trained):
        assert run["losses"][-1] < run["losses"][0]
    for run in (manual, trained):
        assert 0.5 <= run["test_accuracy"] <= 1.0
    # scale_window=50 clean steps double the MindSpore scale; it started at 2**10.
    assert sane_scale(manual["loss_scale"]) and manual["max_loss_scale"] >= 2**11
    assert trained["loss_scale"] == 2**10  # the fixed scale never moves


def test_tf1_manual(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_example("tf1_manual", ["--pretrain-steps", "10", "--steps", "40"])
    out = capsys.readouterr().out
    assert "float32 -> float16" in out
    assert result["converted_o1"] == 0  # O1 stores float32: nothing to cast
    assert result["converted_fp16"] == 8 and all(
        (src, dst) == ("float32", "float16") for _, src, dst in result["conversions"]
    )
    assert result["restored_fp16_test_loss"] == pytest.approx(
        result["pretrain_test_loss"], rel=0.05
    )
    # 2**32 is accepted, overflows, and halves after every second overflow.
    changes = result["scale_changes"]
    assert changes[0] == (2, 2.0**31)
    assert all(b == a / 2 for (_, a), (_, b) in itertools.pairwise(changes))
    assert result["skipped_steps"] >= 2 * len(changes)
    assert sane_scale(result["final_scale"]) and result["final_scale"] < 2**32
    assert result["last_losses"] < result["first_losses"]
    assert 0.0 <= result["token_error_rate"] <= 1.0


RECSYS_ARGS = ["--epochs", "2", "--samples", "4096", "--table-size", "300"]


def test_recsys_embeddings_one_process() -> None:
    result = run_example("recsys_embeddings", RECSYS_ARGS)
    assert result["world_size"] == 1
    assert result["losses"][-1] < result["losses"][0]
    assert result["majority_baseline"] + 0.1 <= result["test_accuracy"] <= 1.0
    assert result["sparse_gradients"] and result["replicas_identical"]
    assert sane_scale(result["loss_scale"])


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)
def test_recsys_embeddings_under_torchrun() -> None:
    env = subprocess_env(torchrun=True)
    # --standalone: a free port, so concurrent runs on one machine do not collide.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(EXAMPLES / "recsys_embeddings.py"), *RECSYS_ARGS]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert out.count("world size 2") == 1  # rank 0 prints, rank 1 does not
    assert "replicas identical on 2 process(es): True" in out
    assert "sparse embedding gradients: True" in out
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in out.splitlines()
              if line.startswith("epoch ")]  # fmt: skip
    assert len(losses) == 2 and losses[-1] < losses[0]
