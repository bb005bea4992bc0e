"""The precision autotuner: each layer's dtype chosen by its measured speed and error.

``plan`` holds ``Plan`` (the per-layer dtypes and the evidence) and ``plan_json`` its JSON;
``units`` the layers a plan gives a dtype; ``measure`` the per-layer times, errors and
range; ``steps`` whole-step timing; ``search`` the greedy search; ``check`` the training
check; ``tune`` ``autotune`` itself; ``plot`` the time-against-error chart.
"""

from mixprec.autotune.plan import LayerChoice, Plan, TrainingCheck
from mixprec.autotune.tune import autotune
from mixprec.autotune.units import Timer, WallTimer

__all__ = ["LayerChoice", "Plan", "Timer", "TrainingCheck", "WallTimer", "autotune"]
