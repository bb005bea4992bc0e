"""The benchmark's workloads: the bundled ones' shapes and FLOPs, and a user's own
``module:function`` workload run from the command line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import mixprec as mp
from mixprec import bench, cli
from mixprec.bench import workloads
from mixprec.models import CausalLM


def tiny_workload() -> bench.Workload:
    """A custom workload, loaded as tests.bench.test_workloads:tiny_workload."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
    return bench.Workload(
        "tiny", lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                            torch.nn.Linear(16, 3)),
        (x, y), F.cross_entropy, 16,
    )  # fmt: skip


def test_custom_workload_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    args = ["bench", "tests.bench.test_workloads:tiny_workload",
            "--modes", "float32,O2-bf16,O1-fp16", "--repeats", "2", "--steps", "1",
            "--warmup", "1", "--no-memory",
            "--json", str(out_json), "--plot", str(out_png)]  # fmt: skip
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "workload tests.bench.test_workloads:tiny_workload" in out and "O2-bf16" in out
    data = json.loads(out_json.read_text())
    rows = data["results"]["tests.bench.test_workloads:tiny_workload"]
    assert [r["mode"] for r in rows] == ["float32", "O2-bf16", "O1-fp16"]
    assert rows[0]["speedup"] == 1.0 and rows[1]["level"] == "O2"
    assert data["outputs_16bit"] is False
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_lm_flops_counts_matrix_weights_and_attention():
    model = CausalLM(vocab=50, d_model=16, n_layers=2, n_heads=2, max_len=8)
    # Per block: qkv 16*48+48, out 16*16+16, mlp 16*64+64 + 64*16+16, two LayerNorms 4*16;
    # then the final LayerNorm 2*16 and the head 16*50+50. Embeddings (50*16, 8*16) excluded.
    block = (16 * 48 + 48) + (16 * 16 + 16) + (16 * 64 + 64) + (64 * 16 + 16) + 4 * 16
    weights = 2 * block + 2 * 16 + 16 * 50 + 50
    tokens, length = 4 * 8, 8
    expected = 6 * weights * tokens + 12 * 2 * 16 * length * tokens
    assert bench.lm_flops(model, tokens, length) == expected


def test_lm_d2048_is_a_gpu_workload_not_run_by_default():
    assert "lm-d2048" in bench.WORKLOADS and "lm-d2048" not in bench.DEFAULT_WORKLOADS
    full, small = bench.get_workload("lm-d2048"), bench.get_workload("lm-d2048", small=True)
    for work, layers, tokens in ((full, 8, 8 * 1024), (small, 1, 2 * 64)):
        model = workloads._on_meta(work.make_model)  # the structure, without 0.4B weights
        assert model.embed.embedding_dim == 2048 and len(model.blocks) == layers
        assert model.blocks[0].n_heads == 16  # head dim 128
        assert work.tokens == tokens and work.flops == bench.lm_flops(
            model, tokens, tokens // work.samples
        )
        assert work.float8 == mp.Float8Options(min_features=2048)
    assert 22e12 < full.flops < 23e12  # model TFLOPs a step: sized for a GPU


def not_a_workload() -> int:
    """A ``module:function`` spec whose function returns something else than a Workload."""
    return 42


def test_a_spec_that_names_no_workload_factory_is_one_clear_error():
    """Issue 32 item 13: ``json:loads`` ended in json's raw TypeError."""
    need = "give a function that takes no arguments and returns a mixprec.bench.Workload"
    missing = r"without arguments \(missing a required argument: 's'\)"
    with pytest.raises(
        ValueError, match="'json:loads': json.loads cannot be called " + missing
    ) as err:
        bench.get_workload("json:loads")
    assert str(err.value).endswith(need)
    spec = "tests.bench.test_workloads:not_a_workload"
    with pytest.raises(ValueError, match="not_a_workload\\(\\) returned int, not a Workload; "):
        bench.get_workload(spec)
    with pytest.raises(ValueError, match="module 'os' has no function 'nosuch'"):
        bench.workload_factory("os:nosuch")
    assert bench.workload_factory("tests.bench.test_workloads:tiny_workload") is tiny_workload
