"""Numerics diagnostics: which layer overflows or underflows in 16 bits (``diagnose``), or
which layer float8 hurts (``doctor.float8``), and what to do about it.

``_common`` holds what both doctors share (the recorder, the relative error); ``diagnose``,
``passes``, ``risk``, ``advice``, ``report`` and ``plot`` the 16-bit doctor; ``float8``,
``float8_casts`` and ``float8_report`` the float8 doctor.
"""

from mixprec.doctor.diagnose import diagnose
from mixprec.doctor.report import ModuleReport, Report

__all__ = ["ModuleReport", "Report", "diagnose"]
