"""Metrics and losses by name, computed in float32 on the model's outputs."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mixprec._dtypes import closest
from mixprec._errors import ArgumentError
from mixprec._warn import warn_at_caller
from mixprec.losses import cross_entropy

Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


#: Cross-entropy's default ``ignore_index``: labels of padding, left out of ``accuracy`` too.
IGNORE_INDEX = -100

#: Epoch log names the Trainer writes itself: a metric of one of these names would merge
#: into them (or overwrite them).
RESERVED = ("loss", "ms_per_step", "samples_per_s", "loss_scale", "skipped_steps")


def accuracy(
    output: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    categorical: bool = False,
    class_dim: int = -1,
) -> torch.Tensor:
    """Mean of correct predictions: argmax over two or more classes (on ``class_dim``: 1
    for torch's cross-entropy, whose outputs are ``(N, C, d1, ...)``), leaving out labels
    of ``ignore_index`` (cross-entropy's padding, -100 unless the loss says otherwise);
    logit > 0 for one output (``(N,)`` or ``(N, 1)``) and for each of several
    (multi-label). ``categorical`` (the Trainer's, under a cross-entropy loss): targets
    shaped as the output are class probabilities (one-hot, mixup), compared by their
    argmax as Keras' categorical accuracy does, not class by class."""
    if categorical and output.shape == target.shape and output.shape[-1] > 1:
        dim = 1 if output.dim() > 2 else -1  # torch's class dimension, (N, C, d1, ...)
        return (output.argmax(dim=dim) == target.argmax(dim=dim)).float().mean()
    if output.dim() == target.dim() + 1 and output.shape[class_dim] > 1:
        kept = target != ignore_index
        hits = (output.argmax(dim=class_dim) == target) & kept
        # A batch of padding alone counts 0 (its loss is NaN, and left out of the means).
        return hits.sum().float() / kept.sum().clamp(min=1)
    output, target = same_shape(output, target, "metric 'accuracy'")
    return ((output > 0).to(target.dtype) == target).float().mean()


def same_shape(
    output: torch.Tensor, target: torch.Tensor, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``output`` and ``target`` of one shape, for a loss or metric that compares them
    element by element: as Keras does, a trailing dimension of 1 on one side (a model with
    one output, ``(N, 1)``, and targets ``(N,)``) is squeezed. Any other difference is a
    ``ValueError``: broadcasting would compare every output with every target."""
    if output.shape != target.shape:
        if output.dim() == target.dim() + 1 and output.shape[-1] == 1:
            output = output.squeeze(-1)
        elif target.dim() == output.dim() + 1 and target.shape[-1] == 1:
            target = target.squeeze(-1)
        if output.shape != target.shape:
            raise ValueError(
                f"{what}: the model's output has shape {tuple(output.shape)} and the targets "
                f"{tuple(target.shape)}; it compares them element by element, so they must "
                "have one shape (up to a trailing dimension of 1)"
            )
    return output, target


def mae(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    output, target = same_shape(output, target, "metric 'mae'")
    return (output.float() - target.float()).abs().mean()


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    output, target = same_shape(output, target, "metric 'mse'")
    return (output.float() - target.float()).pow(2).mean()


METRICS: dict[str, Metric] = {"accuracy": accuracy, "acc": accuracy, "mae": mae, "mse": mse}


def _bce_with_logits(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    output, target = same_shape(output, target, "loss 'binary_crossentropy'")
    return F.binary_cross_entropy_with_logits(output, target.to(output.dtype))


def _mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(*same_shape(output, target, "loss 'mse'"))


def _l1_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.l1_loss(*same_shape(output, target, "loss 'mae'"))


LOSSES: dict[str, LossFn] = {
    "cross_entropy": F.cross_entropy,
    "sparse_categorical_crossentropy": F.cross_entropy,  # the Keras name
    "mse": _mse_loss,
    "mean_squared_error": _mse_loss,
    "mae": _l1_loss,
    "binary_crossentropy": _bce_with_logits,
}


def get_metric(metric: str | Metric) -> tuple[str, Metric]:
    """``(name, function)`` for a metric name or a callable ``(output, target) -> scalar``."""
    if callable(metric):
        return getattr(metric, "__name__", type(metric).__name__), metric
    if isinstance(metric, str) and metric in METRICS:
        return ("accuracy" if metric == "acc" else metric), METRICS[metric]
    hint = closest(str(metric), list(METRICS))
    raise ArgumentError(
        f"metrics entry {metric!r} is not a known metric; valid: {', '.join(METRICS)} or a "
        "callable (output, target) -> scalar" + (f" (closest: {hint!r})" if hint else "")
    )


def get_metrics(
    metrics: str | Metric | Sequence[str | Metric] | Mapping[str, str | Metric],
    loss_fn: LossFn | None = None,
) -> dict[str, Metric]:
    """The Trainer's ``metrics``: names or callables (one, a sequence, or a mapping from
    the name to log to either). Two of one name (two lambdas, two instances of a class) or
    a name the Trainer logs itself would overwrite each other without a word: refused.
    Under a cross-entropy ``loss_fn``, ``accuracy`` leaves out the labels the loss leaves
    out, and reads probability targets by their argmax."""
    if isinstance(metrics, str) or callable(metrics):
        metrics = [metrics]  # one metric, not the letters of its name
    if isinstance(metrics, Mapping):
        pairs = [(str(name), get_metric(m)[1]) for name, m in metrics.items()]
    else:
        pairs = [get_metric(m) for m in metrics]
    named: dict[str, Metric] = {}
    for name, fn in pairs:
        if name in RESERVED or name.startswith("val_"):
            raise ArgumentError(
                f"metrics: a metric named {name!r} would overwrite the epoch log of that name "
                f"(the Trainer logs {', '.join(RESERVED)}, and val_ + each for validation); "
                "name it otherwise, e.g. metrics={'my_name': fn}"
            )
        if name in named:
            raise ArgumentError(
                f"metrics: two metrics are named {name!r}, and only the last would be logged; "
                "name them apart: metrics={'first': fn1, 'second': fn2}"
            )
        named[name] = fn
    ignore = None if loss_fn is None else ignore_index_of(loss_fn)
    if ignore is not None:
        # torch's cross-entropy reads classes on dim 1 of (N, C, L) outputs: the argmax over
        # the last dim compared positions with labels (0.19 for 0.15, unsaid, where C = L).
        dim = 1 if loss_fn is not None and _classes_on_dim_1(loss_fn) else -1
        as_loss = functools.partial(accuracy, ignore_index=ignore, categorical=True, class_dim=dim)
        named = {k: as_loss if fn is accuracy else fn for k, fn in named.items()}
    return named


def ignore_index_of(loss_fn: LossFn) -> int | None:
    """The label a cross-entropy loss leaves out (``ignore_index``, -100 unless set), for
    ``F.cross_entropy``, ``nn.CrossEntropyLoss``, ``mp.cross_entropy`` and a
    ``functools.partial`` of either function; ``None`` for any other loss."""
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        return int(loss_fn.ignore_index)
    func, keywords = loss_fn, {}
    if isinstance(loss_fn, functools.partial):
        func, keywords = loss_fn.func, loss_fn.keywords
    if func is F.cross_entropy or func is cross_entropy:
        return int(keywords.get("ignore_index", IGNORE_INDEX))
    return None


def _classes_on_dim_1(loss_fn: LossFn) -> bool:
    """torch's cross-entropy (``F.cross_entropy``, ``nn.CrossEntropyLoss``), whose class
    dimension is 1; ``mp.cross_entropy`` takes it last."""
    func = loss_fn.func if isinstance(loss_fn, functools.partial) else loss_fn
    return func is F.cross_entropy or isinstance(func, nn.CrossEntropyLoss)


def class_dim(loss_fn: LossFn, output: torch.Tensor) -> int:
    """The dimension of ``output`` that holds the classes under ``loss_fn``."""
    return 1 if output.dim() > 2 and _classes_on_dim_1(loss_fn) else -1


def counted(loss_fn: LossFn, targets: torch.Tensor) -> int:
    """How many items a batch's mean loss and metrics average over, to weight it by in an
    epoch's or an evaluation's means: its rows, or under a cross-entropy loss with class
    labels, the labels it keeps (not ``ignore_index``). Weighted by rows, padded
    sequences' means depended on the batch size (accuracy 0.083 at batch 4 and 0.143 at
    batch 8 for the same model). One host read under such a loss."""
    ignore = ignore_index_of(loss_fn)
    if ignore is None or targets.is_floating_point() or targets.dim() == 0:
        return len(targets)
    return int((targets != ignore).sum())


def weigh_for(loss_fn: LossFn, targets: torch.Tensor | None) -> Callable[[torch.Tensor], int]:
    """How ``fit`` weighs each batch in the epoch's means, chosen once from the whole
    data's ``targets``: ``counted``, or where no label is the loss's ``ignore_index``, the
    number of labels, which ``counted`` would return for every batch, without its per-step
    reduction and host read (on CUDA a synchronisation a step). ``None``: a loader."""
    ignore = ignore_index_of(loss_fn)
    counts_all = not (
        ignore is None
        or targets is None
        or targets.is_floating_point()
        or targets.dim() == 0
        or bool((targets == ignore).any())  # padded: each batch counts what it keeps
    )
    return torch.Tensor.numel if counts_all else functools.partial(counted, loss_fn)


def get_loss(loss: str | LossFn) -> LossFn:
    """A loss function from a name or a callable (``nn.Module`` losses included)."""
    if callable(loss):
        return loss
    if isinstance(loss, str) and loss in LOSSES:
        return LOSSES[loss]
    hint = closest(str(loss), list(LOSSES))
    raise ArgumentError(
        f"loss={loss!r} is not a known loss; valid: {', '.join(LOSSES)} or a callable "
        "(output, target) -> scalar" + (f" (closest: {hint!r})" if hint else "")
    )


def say_if_probabilities(model: nn.Module, loss_fn: LossFn, loss: object) -> None:
    """A model that ends in ``nn.Softmax`` (``nn.Sigmoid``) under a loss that takes logits,
    cross-entropy (binary cross-entropy with logits): the Keras habit of probability
    outputs (whose losses default to ``from_logits=False``) trains worse and its accuracy
    reads wrong (every probability is > 0). Said once, at the Trainer's construction, for
    a model whose last module can be told (an ``nn.Sequential``)."""
    last = model
    while isinstance(last, nn.Sequential) and len(last):
        last = last[-1]
    func = loss_fn.func if isinstance(loss_fn, functools.partial) else loss_fn
    logits_bce = func in (_bce_with_logits, F.binary_cross_entropy_with_logits) or isinstance(
        func, nn.BCEWithLogitsLoss
    )
    if isinstance(last, nn.Softmax) and ignore_index_of(loss_fn) is not None:
        fix, ending = "nn.Softmax", "cross-entropy, which applies log_softmax itself"
    elif isinstance(last, nn.Sigmoid) and logits_bce:
        fix, ending = "nn.Sigmoid", "binary cross-entropy with logits, which applies the sigmoid"
    else:
        return
    given = loss.func if isinstance(loss, functools.partial) else loss
    name = loss if isinstance(loss, str) else getattr(given, "__name__", type(given).__name__)
    warn_at_caller(
        f"the model ends in {fix} and the loss ({name}) is {ending}: it would be applied "
        f"twice (Keras' losses take probabilities by default; these take logits). Drop the "
        f"final {fix} from the model and apply it to predict()'s outputs"
    )
