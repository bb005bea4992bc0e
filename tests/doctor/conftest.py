"""Fixtures the doctor tests share: one torch thread where a test asks for it, and the
tensorwise float8 diagnosis several float8 test modules read (computed once)."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from tests.doctor.cases import single_thread
from tests.doctor.float8_cases import BATCH, SMALL, readings, sensors


@pytest.fixture
def one_thread():
    """Emulated 16-bit backward on this machine's 2 shared cores: two threads contend
    (measured 9.6 s against 1.3 s for the back-off test)."""
    with single_thread():
        yield


@pytest.fixture(scope="package")
def tensorwise():
    """``diagnose_float8`` of the sensors model under ``mixed_float8`` (tensorwise scaling),
    on one thread as the float8 test modules run. The float8 modules skip without torchao
    before they ask for it."""
    from mixprec.doctor.float8 import diagnose_float8

    x, y = readings(BATCH, seed=0)
    with single_thread():
        return diagnose_float8(sensors(), x, y, F.mse_loss, "mixed_float8", float8=SMALL)
