"""Helpers shared by the scaling tests."""

from __future__ import annotations

import mixprec as mp


def run(scaler: mp.LossScaler, overflows: list[bool]) -> list[float]:
    scales = []
    for found in overflows:
        scaler.update(found)
        scales.append(scaler.get_scale())
    return scales
