"""Exact resume: N steps, save, load in a fresh process, N more == 2N uninterrupted, bitwise
(weights, optimizer state, loss scale), through the Trainer and a custom loop; and atomic
saves under SIGKILL."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import mixprec as mp
from tests.conftest import subprocess_env

WORKER = Path(__file__).with_name("_resume_worker.py")


def worker(*args: str) -> None:
    env = subprocess_env()
    subprocess.run([sys.executable, str(WORKER), *args], check=True, env=env, timeout=300)


def assert_bitwise_equal(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def test_trainer_resume_is_bitwise_identical(tmp_path):
    ckpt = tmp_path / "ckpt"
    worker("fit-full", str(ckpt), str(tmp_path / "full.pt"))
    worker("fit-part", str(ckpt), "")
    assert (ckpt / "step-00000013.safetensors").exists()
    worker("fit-resume", str(ckpt), str(tmp_path / "resumed.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert full["skipped"] >= 3  # the overflowing batch, once per epoch (before the save too)
    assert_bitwise_equal(full, resumed)


def test_custom_loop_resume_is_bitwise_identical(tmp_path):
    ckpt = str(tmp_path / "loop.safetensors")
    worker("loop-full", ckpt, str(tmp_path / "full.pt"))
    worker("loop-part", ckpt, "")
    worker("loop-resume", ckpt, str(tmp_path / "resumed.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert_bitwise_equal(full, resumed)


SAVER = """
import sys, torch, mixprec as mp
model = torch.nn.Linear(1024, 1024)
i = int(sys.argv[2])
while True:
    i += 1
    with torch.no_grad():
        model.weight.fill_(i)
        model.bias.fill_(i)
    mp.save_checkpoint(sys.argv[1], model, trainer_state={"i": i})
    print(i, flush=True)
"""


def test_sigkill_while_saving_leaves_old_or_new_checkpoint(tmp_path):
    path = tmp_path / "c.safetensors"
    model = torch.nn.Linear(1024, 1024)
    with torch.no_grad():
        model.weight.fill_(0)
        model.bias.fill_(0)
    mp.save_checkpoint(path, model, trainer_state={"i": 0})
    rng = random.Random(0)
    env = subprocess_env()
    last = 0
    kills = 0
    while kills < 10:  # each kill costs a fresh interpreter importing torch (~3 s)
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, str(path), str(last)],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        first = proc.stdout.readline()  # one save done: the loop is running
        assert first.strip(), "saver died before its first save"
        time.sleep(rng.uniform(0.0, 0.25))  # land anywhere inside a later save
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        report = mp.load_checkpoint(path, model)  # never an error
        i = report.trainer_state["i"]
        assert i >= int(first)  # the old or a newer complete checkpoint
        assert torch.all(model.weight == i) and torch.all(model.bias == i)  # and consistent
        last = i
