"""``MasterWeights``: the float32 master copies behind a model's 16-bit parameters.

The inner optimizer updates float32 masters, so its state stays float32 and small updates
are not rounded away; after an applied step the masters are copied back into the 16-bit
weights with one multi-tensor copy. Parameters without a master (float32 ones, and O3's
16-bit ones, which O3 updates in place) are "plain": the inner optimizer updates them as
they are. The weights' version counters show writes made outside the optimizer
(``model.load_state_dict``), which then replace the masters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from mixprec._aliases import frozen_aliases
from mixprec._dist import is_dtensor
from mixprec._dtypes import dtype_name
from mixprec._errors import ArgumentError
from mixprec._float32_copies import take_float32_copy
from mixprec._live_masters import float32_start, forget_gone_master, note_master, take_masters
from mixprec._plain_optimizers import needs_master
from mixprec._warn import warn_at_caller
from mixprec.optim import rounding
from mixprec.scaling import all_finite
from mixprec.trace import model_of

__all__ = ["MasterWeights", "needs_master"]

_DATA_SAMPLE = 4096  # values of each weight the one look for writes through .data compares


# Every master made, weakly: an optimizer wrapped twice holds them (``_refuse_master``).
_MASTERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class MasterWeights:
    """The 16-bit parameters with float32 masters, their masters, and the plain parameters.

    ``half`` and ``masters`` are in the same order; ``checked`` holds the float16 weights
    (local shards under FSDP2), which an update can push past 65504 while their float32
    masters stay finite. (bfloat16 has float32's range: it overflows only where float32
    training would, which no one checks either.) ``versions`` are the 16-bit weights'
    version counters as this object last wrote or read them.

    A plain object, not the ``Optimizer``: inside ``torch.compile(opt.step)`` dynamo drops
    attribute writes on the ``Optimizer`` itself (torch 2.13), not on other objects.
    """

    def __init__(self) -> None:
        self.half: list[torch.Tensor] = []  # 16-bit model parameters with masters
        self.masters: list[torch.Tensor] = []  # their float32 masters, same order
        self.stored: list[torch.dtype] = []  # the 16-bit weights' dtypes when adopted
        self.plain: list[torch.Tensor] = []  # parameters the inner optimizer updates as is
        self.index: dict[int, tuple[bool, int]] = {}  # id(param) -> (has master, position)
        self.checked: list[torch.Tensor] = []  # float16 weights, checked after each update
        self.versions: list[tuple[int, int]] = []
        # Keep the masters' float32 gradients across zero_grad (keep_grad_buffers=True):
        self.keep_grads = False  # 4 bytes a parameter through the forward, no new allocation
        # Every parameter on the CPU and local (no DTensor): checks may read their answer at
        # once, as that costs no device synchronisation.
        self.on_host = True
        self.saw_sparse = False  # a sparse gradient was seen (fused groups then step unfused)
        self.lost = 0  # weights whose earlier master is gone: they start from their rounding
        self.state_view: Any = None  # LossScaleOptimizer.state's StateView, made at first use
        # Steps that looked for external writes, to 2: the second also sees .data writes.
        self.step_looks = 0
        self.said_data_saves = self.said_frozen = False  # said once (.data saves; checks)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled or deep-copied with its optimizer: the parameters are new objects, so
        # what is known by their identity is made again (a later optimizer over the model
        # starts from these masters), and their versions are read anew.
        self.__dict__.update(state)
        self.index = {id(p): (True, i) for i, p in enumerate(self.half)}
        self.index.update({id(p): (False, i) for i, p in enumerate(self.plain)})
        for p, master, stored in zip(self.half, self.masters, self.stored, strict=True):
            note_master(p, master, stored)
            _MASTERS[master] = True
        self.versions = self.half_versions()

    def adopt(
        self, inner: torch.optim.Optimizer, params: list[torch.Tensor], where: str
    ) -> list[torch.Tensor]:
        """Swap 16-bit parameters for float32 masters in a param group's list, and note
        every 16-bit weight's version."""
        adopted = []
        master_ids = {id(m) for m in self.masters}
        aliases = frozen_aliases(params, self.half, where, needs_master)  # get no master
        for j, p in enumerate(params):
            _check_param(p, f"{where}['params'][{j}]")
            if id(p) in self.index or id(p) in master_ids:
                # torch refuses this within one optimizer; here the first would be swapped
                # for its master before torch's check, and two masters would train it.
                raise ArgumentError(
                    f"{where}['params'][{j}] (shape {tuple(p.shape)}, {p.dtype}) is already "
                    "a parameter of this LossScaleOptimizer; a parameter may appear in one "
                    "param group of one inner optimizer only"
                )
            _refuse_master(p, f"{where}['params'][{j}]")
            if p.dtype == torch.float16:
                self.checked.append(_local(p))
            if needs_master(p) and id(p) not in aliases:
                _refuse_sharded(p, f"{where}['params'][{j}]")
                master, lost = float32_start(p)
                self.lost += lost and forget_gone_master(p)  # not if loaded anew since
                master.requires_grad_(True)
                note_master(p, master, p.dtype)
                _MASTERS[master] = True
                state = inner.state.pop(p, None)
                if state:
                    # Moments become float32 like the master; scalar entries (step) stay as is.
                    inner.state[master] = {
                        k: v.float()
                        if torch.is_tensor(v) and v.is_floating_point() and v.dim()
                        else v
                        for k, v in state.items()
                    }
                self.index[id(p)] = (True, len(self.half))
                self.half.append(p)
                self.stored.append(p.dtype)
                self.masters.append(master)
                adopted.append(master)
            else:
                take_masters((p,))  # widened since its master was made (model.float())
                self.index[id(p)] = (False, len(self.plain))
                self.plain.append(p)
                adopted.append(p)
            self.on_host = self.on_host and p.device.type == "cpu" and not is_dtensor(p)
        self.versions = self.half_versions()  # new 16-bit parameters have versions too
        return adopted

    def model_params(self) -> list[torch.Tensor]:
        """The model's parameters: the 16-bit ones with masters, then the plain ones."""
        return self.half + self.plain

    def half_versions(self) -> list[tuple[int, int]]:
        """Each 16-bit weight's version and storage: an in-place write bumps the one,
        ``param.data = ...`` (``prune.remove``, ``vector_to_parameters``) swaps the other.
        (No DTensor shard is among them: ``_refuse_sharded``.) Traced by dynamo, the storage
        comparison is a graph break of its own in ``torch.compile(opt.step)``; noting
        versions alone there would make every eager step after a compiled one look written."""
        return [(p._version, p.data_ptr()) for p in self.half]

    def follow_external_writes(self, stepping: bool = False) -> None:
        """A 16-bit weight written outside this optimizer (``model.load_state_dict``)
        replaces its master; otherwise the next copy-back would undo the write. Where the
        write came with the float32 values it rounds from (a checkpoint's masters, kept on
        the weight by ``load_checkpoint`` or the Hugging Face paths), the master takes
        those. A write of the master's own rounding (a checkpoint's 16-bit weights loaded
        after its masters) changes nothing, and the master keeps its float32 digits.
        ``stepping``: a step asks (the second one also looks for writes through ``.data``),
        not a save."""
        versions = self.half_versions()
        if versions != self.versions:
            with torch.no_grad():
                for p, m, stored, now, then in zip(
                    self.half, self.masters, self.stored, versions, self.versions, strict=True
                ):
                    if now != then and (kept := take_float32_copy(p)) is not None:
                        m.copy_(kept)  # one host read, after a load only
                    elif now != then:
                        # Decided on the device, element by element (no read on the host):
                        # where the weight is still the master's rounding the master keeps
                        # its digits; elsewhere it takes the written value. A constraint
                        # that clamps one element (WGAN's clip, a padding row) replaced the
                        # whole master once, and the others' sub-ulp progress with it.
                        low = rounding.narrower(p.dtype, stored)
                        m.copy_(torch.where(m.to(low) == p.to(low), m, p.float()))
            self.versions = versions
        if stepping and self.step_looks < 2:  # a step's look, not a save's
            self.step_looks += 1
            if self.step_looks == 2:  # the first step's copy-back came before it
                self._say_writes_through_data()

    def follow_data_writes(self) -> None:
        """Before a save, which writes the masters: 16-bit weights that differ from their
        masters by more than rounding, written through ``.data`` (an average applied with
        ``p.data.copy_``, a constraint), give their masters those values, element by
        element, and are said once. Else the save wrote the masters the model no longer
        holds (the model evaluated was not the model saved), and the next step undid the
        write. A save reads every weight anyway; steps do not look (see below)."""
        moved = 0
        with torch.no_grad():
            for p, m, stored in zip(self.half, self.masters, self.stored, strict=True):
                # The usual case first, in the weight's own dtype (a 16-bit temporary, not
                # four float32 ones: a 64M-value table took 1 GB and 1.5 s that way).
                low = rounding.narrower(p.dtype, stored)
                if torch.equal(m.to(low), p.to(low)):
                    continue
                w = p.float()
                far = rounding.moved(w, m, low)
                if bool(far.any()):
                    m.copy_(torch.where(far, w, m))
                    moved += 1
        if moved and not self.said_data_saves:
            self.said_data_saves = True
            warn_at_caller(
                f"{moved} 16-bit weight(s) differ from their float32 masters by more than "
                "rounding: written through .data (p.data.copy_(...), p.data.mul_(...)), which "
                "the optimizer does not see. This save takes them where they moved by more "
                "than rounding (within it, an element keeps its master); a step undoes such a "
                "write. Write on the weight under torch.no_grad() (p.copy_(...)): followed exactly"
            )

    def _say_writes_through_data(self) -> None:
        """Once, at the second step: 16-bit weights that moved away from their masters by
        more than rounding with their version counters unchanged, written through
        ``.data`` since the first step's copy-back (WGAN's ``p.data.clamp_(-c, c)``), which
        the copy-back undoes at every step. Said, not followed: later steps do not look
        (one comparison of every weight and a host read, once in a run), and a compiled
        step's copy-back may round a weight an ulp away from its master."""
        pairs = list(zip(self.half, self.masters, self.stored, strict=True))
        if not pairs:
            return
        with torch.no_grad():
            flags = []
            for p, m, stored in pairs:
                # Up to 4096 values of each, spread over it: a write through .data (a clamp,
                # a re-init) moves most of a weight, and whole float32 copies of the large
                # ones raised the main job's peak memory by 20-50 MB.
                stride = max(1, p.numel() // _DATA_SAMPLE)
                w, v = p.reshape(-1)[::stride].float(), m.reshape(-1)[::stride]
                flags.append(rounding.moved(w, v, rounding.narrower(p.dtype, stored)).any())
            moved = sum(torch.stack(flags).tolist())
        if moved:
            warn_at_caller(
                f"{moved} 16-bit weight(s) moved since the last step with their version "
                "counters unchanged: written through .data (p.data.clamp_(...), say), which "
                "the next step's copy-back from the float32 masters undoes, at every step. "
                "Write on the weight itself under torch.no_grad() (p.clamp_(...)): the "
                "optimizer then follows the write into the master"
            )

    def copy_back(self) -> None:
        """The masters into the 16-bit weights (one multi-tensor copy), whose versions are
        then this object's own writes, not external ones."""
        if self.half:
            with torch.no_grad():
                torch._foreach_copy_(self.half, self.masters)
        self.versions = self.half_versions()

    def load(self, masters: list[torch.Tensor]) -> None:
        """Take saved masters (checked against these) and copy them into the weights."""
        if masters:
            with torch.no_grad():
                torch._foreach_copy_(self.masters, list(masters))
        self.copy_back()

    def broadcast(self, src: int) -> None:
        """Make every rank's masters (and so 16-bit weights) those of rank ``src``."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        with torch.no_grad():
            for master in self.masters:
                dist.broadcast(master, src)
        self.copy_back()

    # -- gradients --------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool) -> None:
        params = self.half + self.plain
        if set_to_none:
            # The master gradients go too unless kept: kept, they sit beside the next forward's
            # activations (4 bytes a parameter at the peak); freed, each step allocates them
            # again: page faults where the allocator gives memory back (8192-MLP AdamW: 16%).
            for p in params if self.keep_grads else params + self.masters:
                p.grad = None
        else:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)

    def load_master_grads(self) -> None:
        """The 16-bit gradients into the masters' (one multi-tensor copy); none into one
        frozen through ``opt.param_groups`` (whose weight still took one)."""
        src, dst = [], []
        for p, m in zip(self.half, self.masters, strict=True):
            g = p.grad
            if g is None or not m.requires_grad:
                m.grad = None
            elif g.is_sparse:
                # Widen before coalescing: summing duplicate indices in 16 bits can overflow.
                m.grad = g.float().coalesce()
                self.saw_sparse = True
            else:
                if m.grad is None or m.grad.is_sparse:
                    m.grad = torch.empty_like(m)
                src.append(g)
                dst.append(m.grad)
        if src:
            torch._foreach_copy_(dst, src)

    def plain_grads(self) -> list[torch.Tensor]:
        grads = []
        for p in self.plain:
            g = p.grad
            if g is not None:
                if g.is_sparse:
                    self.saw_sparse = True
                    if g.dtype == torch.float16:
                        g = p.grad = g.coalesce()
                grads.append(g)
        return grads

    def step_grads(self) -> list[torch.Tensor]:
        """The gradients the inner optimizers read: the masters', then the plain ones'."""
        return [m.grad for m in self.masters if m.grad is not None] + self.plain_grads()

    # -- float16 weights past their range ---------------------------------------------------

    def raise_nonfinite_weights(self) -> None:
        """Raise ``FloatingPointError`` naming the float16 weights that are inf or NaN."""
        params = self.half + self.plain
        model = model_of(params)
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        lines = []
        for k, p in enumerate(params):
            if p.dtype != torch.float16 or bool(all_finite([_local(p)])):
                continue
            line = f"{names.get(id(p), f'parameter {k}')} ({dtype_name(p.dtype)}"
            if k < len(self.half):
                master = self.masters[k].detach()
                line += f"; its float32 master's largest |value| is {master.abs().max().item():g}"
            lines.append(line + ")")
        more = f"; and {len(lines) - 5} more" if len(lines) > 5 else ""
        found = "; ".join(lines[:5]) + more if lines else "on another rank"
        raise FloatingPointError(
            f"float16 weights became inf or NaN in the last applied update: {found}. Every "
            "later step would train on them. float16 holds no value past 65504: keep the "
            "module in float32 (keep_float32=[...]) or train in bfloat16 "
            "(policy='mixed_bfloat16'); an inf or NaN master needs a smaller learning rate or "
            "max_grad_norm="
        )


def _check_param(p: Any, where: str) -> None:
    if not isinstance(p, torch.Tensor):
        raise ArgumentError(f"{where} must be a tensor, got {type(p).__name__}")
    if not p.is_floating_point():  # a complex one: its gradients' inf check and unscale
        raise ArgumentError(  # would need their real view
            f"{where} has dtype {p.dtype}; a LossScaleOptimizer steps real floating-point "
            "parameters (float32, float64, float16, bfloat16). Step a complex one with an "
            "optimizer of its own, outside the wrapper, under a policy with no loss scaling "
            "(float32, bfloat16): under float16 its gradients would stay scaled"
        )


def _local(p: torch.Tensor) -> torch.Tensor:
    """The local shard of an FSDP2 parameter, else the parameter."""
    return p.to_local() if is_dtensor(p) else p  # type: ignore[attr-defined,no-any-return]


def _refuse_master(p: torch.Tensor, where: str) -> None:
    """A torch optimizer wrapped twice (a cell run again) holds the first wrapper's masters:
    the second took them for float32 parameters, and the weights were never stepped again."""
    if p in _MASTERS:
        raise ArgumentError(
            f"{where} is the float32 master of a 16-bit weight (shape {tuple(p.shape)}): "
            "this torch optimizer was wrapped in a LossScaleOptimizer already (a cell run "
            "again?), whose masters replaced the model's weights in it. A second wrapper "
            "would step the masters alone and leave the weights as they are. Keep using the "
            "first wrapper, or build a new torch optimizer over model.parameters() and wrap "
            "that"
        )


def _refuse_sharded(p: torch.Tensor, where: str) -> None:
    """A 16-bit DTensor shard (an O2/O3 model given to FSDP2's fully_shard) gets no master:
    its first step died in torch's raw "no sharding strategy for _foreach_copy_". FSDP2's
    own float32 shards are the masters."""
    if is_dtensor(p):
        raise ArgumentError(
            f"{where} is a {p.dtype} DTensor shard: a model prepared at O2 or O3 and then "
            "sharded by fully_shard. FSDP2 keeps float32 shards as the master weights: "
            "shard the float32 model (level O0, or unprepared) with "
            "fully_shard(..., mp_policy=mixprec.distributed.fsdp_mixed_precision(policy))"
        )
