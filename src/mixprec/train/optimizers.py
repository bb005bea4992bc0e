"""Optimizers by name, as Keras users write them: ``Trainer(model, "cross_entropy", "adam")``.

Each name builds the torch optimizer with Keras' default hyper-parameters, so that a model
ported from ``model.compile(optimizer="adam")`` trains with the same settings:

=========  ==============================================================================
adam       ``Adam(lr=1e-3, betas=(0.9, 0.999), eps=1e-7)``
adamw      ``AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-7, weight_decay=0.004)`` (Keras 3)
sgd        ``SGD(lr=0.01)``, no momentum
rmsprop    ``RMSprop(lr=1e-3, alpha=0.9, eps=1e-7)`` (Keras' ``rho`` is torch's ``alpha``)
adagrad    ``Adagrad(lr=1e-3, initial_accumulator_value=0.1, eps=1e-7)``
=========  ==============================================================================

torch's defaults differ (Adam's ``eps=1e-8``, AdamW's ``weight_decay=0.01``, RMSprop's
``alpha=0.99``, SGD has no default learning rate); for other settings, pass an optimizer.
The update rules are torch's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from mixprec._dtypes import closest
from mixprec._errors import ArgumentError

__all__ = ["OPTIMIZERS", "get_optimizer"]

_Factory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]

#: Keras' optimizer names and the torch optimizers with Keras' defaults they build.
OPTIMIZERS: dict[str, _Factory] = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-7),
    "adamw": lambda params: torch.optim.AdamW(
        params, lr=1e-3, betas=(0.9, 0.999), eps=1e-7, weight_decay=0.004
    ),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3, alpha=0.9, eps=1e-7),
    "adagrad": lambda params: torch.optim.Adagrad(
        params, lr=1e-3, initial_accumulator_value=0.1, eps=1e-7
    ),
}


def get_optimizer(optimizer: str, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch optimizer ``optimizer`` names (any case) over ``params``, with Keras'
    defaults."""
    factory = OPTIMIZERS.get(optimizer.strip().lower())
    if factory is None:
        hint = closest(optimizer.strip().lower(), list(OPTIMIZERS))
        raise ArgumentError(
            f"optimizer={optimizer!r} is not a known optimizer; valid: "
            f"{', '.join(OPTIMIZERS)} (with Keras' defaults) or a torch.optim.Optimizer"
            + (f" (closest: {hint!r})" if hint else "")
        )
    return factory(params)
