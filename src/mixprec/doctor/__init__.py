"""Numerics diagnostics: which layer overflows or underflows in 16 bits (``diagnose``), or
which layer float8 hurts (``doctor.float8``), and what to do about it.

``_common`` holds what both doctors share (the recorder, the relative error, the refusal of
a non-finite batch); ``diagnose``, ``passes``, ``risk``, ``headroom``, ``verify``,
``advice``, ``report`` and ``plot`` the 16-bit doctor; ``float8``, ``float8_casts`` and
``float8_report`` the float8 doctor.
"""

# What the autotuner measures with, as the doctors do: for mixprec's other subpackages,
# which do not reach into the private module (not in __all__).
from mixprec.doctor._common import Recorder as Recorder
from mixprec.doctor._common import check_callable as check_callable
from mixprec.doctor._common import check_finite_batch as check_finite_batch
from mixprec.doctor._common import float32_model as float32_model
from mixprec.doctor._common import relative_error as relative_error
from mixprec.doctor._common import to_json as to_json
from mixprec.doctor.diagnose import diagnose
from mixprec.doctor.report import ModuleReport, PlanCheck, Report

__all__ = ["ModuleReport", "PlanCheck", "Report", "diagnose"]
