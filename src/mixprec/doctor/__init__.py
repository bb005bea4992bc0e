"""Numerics diagnostics: which layer overflows or underflows in 16 bits (``diagnose``), or
which layer float8 hurts (``doctor.float8``), and what to do about it.

``_common`` holds what both doctors share (the recorder, the relative error, the refusal of
a non-finite batch); ``diagnose``, ``passes``, ``risk``, ``headroom``, ``verify``,
``advice``, ``report`` and ``plot`` the 16-bit doctor; ``float8``, ``float8_casts`` and
``float8_report`` the float8 doctor.
"""

from mixprec.doctor.diagnose import diagnose
from mixprec.doctor.report import ModuleReport, PlanCheck, Report

__all__ = ["ModuleReport", "PlanCheck", "Report", "diagnose"]
