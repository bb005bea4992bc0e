"""The public surface: ``mp.__all__`` is a stored list, and every name in it resolves to the
object its home module defines. A name dropped, renamed or added by accident fails here."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import mixprec as mp

#: ``mp.__all__`` as users rely on it. Add a name here only together with a CHANGELOG entry.
PUBLIC = [
    "ArgumentError", "CSVLogger", "Callback", "CheckpointError", "CompensatedAdamW",
    "DynamicLossScaleManager", "DynamicLossScaler", "EMA", "EarlyStopping",
    "ExponentialUpdateLossScaleManager", "Float8LayerReport", "Float8Options", "Float8Report",
    "GradScaler", "History", "LEVELS", "LearningRateScheduler", "LoadReport", "LossMonitor",
    "LossScaleOptimizer", "LossScaler", "MisuseError", "ModelCheckpoint", "ModuleReport",
    "NoOpLossScaler", "Overflow", "Plan", "Policy", "ProgressBar", "Report", "ScalerHealth",
    "ScalerState", "StaticLossScaler", "StepResult", "TensorBoard", "TrainStep", "Trainer",
    "__version__", "activation_checkpoint", "all_finite", "auto_mixed_precision", "autotune",
    "build_train_step", "cast_floating", "checkpoint_context", "convert_checkpoint",
    "cross_entropy", "data", "describe", "diagnose",
    "diagnose_float8", "distributed", "export_weights", "get_policy", "global_policy",
    "load_checkpoint", "losses", "models", "module_dtypes", "policy_scope", "read_checkpoint",
    "release_float32_copies", "save_checkpoint", "set_global_policy",
    "split_embedding_parameters", "stochastic_round", "to_float",
]  # fmt: skip


def test_all_is_the_stored_list():
    assert sorted(mp.__all__) == sorted(PUBLIC)
    assert len(set(mp.__all__)) == len(mp.__all__), "a name is listed twice in __all__"


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_resolves(name):
    value = getattr(mp, name)
    assert value is not None
    home = getattr(value, "__module__", None)
    if isinstance(home, str) and home.startswith("mixprec"):
        # Re-exported, not redefined: the root's object is the one its module holds.
        assert getattr(importlib.import_module(home), getattr(value, "__name__", name)) is value


def test_version_is_the_packaged_one():
    from importlib.metadata import version

    assert mp.__version__ == version("mixprec")


def test_command_line_entry_points_resolve():
    from mixprec.cli import main

    assert callable(main)
    main_module = (Path(mp.__file__).parent / "__main__.py").read_text()
    assert "from mixprec.cli import main" in main_module  # what ``python -m mixprec`` runs
