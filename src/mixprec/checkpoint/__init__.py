"""Checkpoints: safetensors tensors plus a JSON header, written atomically, loaded with
dtype conversion, never executing code from the file.

``format`` holds the format, its limits and errors; ``save``, ``read``, ``load`` and
``export`` the public functions; the private modules the files (``_files``), the
safetensors framing (``_safetensors``), the header's schema (``_schema``), dtype conversion
(``_conversion``), nested state (``_tree``), RNG states (``_rng``) and the model's stored
tensors (``_model``).

One private name is re-exported: ``_checksum``, with which tests rewrite headers. Four
names of the private modules are re-exported for mixprec's other subpackages (not in
``__all__``): a model's state with its masters in place (``masters_in_place``,
``masters_of``: the Trainer's best weights, the integrations' saves), ``same_file`` and
``SAFETENSORS_DTYPES`` (``mixprec convert``).
"""

from mixprec.checkpoint._files import same_file as same_file
from mixprec.checkpoint._files import temporary_files
from mixprec.checkpoint._model import masters_in_place as masters_in_place
from mixprec.checkpoint._model import masters_of as masters_of
from mixprec.checkpoint._rng import rng_state
from mixprec.checkpoint._safetensors import SAFETENSORS_DTYPES as SAFETENSORS_DTYPES
from mixprec.checkpoint.export import convert_checkpoint, export_weights
from mixprec.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    CheckpointError,
    LoadReport,
    OnRange,
)
from mixprec.checkpoint.format import _checksum as _checksum
from mixprec.checkpoint.load import load_checkpoint
from mixprec.checkpoint.read import read_checkpoint, trainer_state
from mixprec.checkpoint.save import save_checkpoint

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "CheckpointError",
    "LoadReport",
    "OnRange",
    "convert_checkpoint",
    "export_weights",
    "load_checkpoint",
    "read_checkpoint",
    "rng_state",
    "save_checkpoint",
    "temporary_files",
    "trainer_state",
]
