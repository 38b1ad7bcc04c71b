"""Overlapped staging: which tensors a save may copy after ``save()`` returns, and the proof
that they were not changed before that copy ended.

A tensor is deferred only when both halves of the proof hold:

- structural: it belongs to an optimizer whose step hooks provably run (a real
  ``torch.optim.Optimizer`` whose class ``step`` torch has wrapped with its hook dispatcher, whose
  own hook table exists, and whose ``step`` is not replaced on the instance). Wrappers that
  delegate (TorchRec's ``CombinedOptimizer``, ``KeyedOptimizerWrapper``, ``OptimizerWrapper``, by
  attribute so TorchRec need not be imported) are walked to the optimizers that do the updates;
  their pre-hook waits for the copy. And nothing mutates it out of band: a storage that fbgemm's
  TBE or a TorchRec fused module owns (updated inside backward, without a version bump), a
  parameter with an in-backward optimizer, an ``Embedding(max_norm=...)`` weight (renormalised in
  forward), or a tensor an unproven optimizer also holds, is copied inside ``save()``.
- runtime: each deferred tensor's version counter is read at ``save()`` and again once its copy
  is done, before the optimizer's step may run; a change fails the save (:class:`TornSnapshot`,
  nothing is sent) and that optimizer's tensors are copied inside ``save()`` from then on.

The runtime half cannot see writes made without autograd's knowledge (they do not bump the
version counter): through ``.data``, ``.numpy()`` or other aliases, by c10d collectives into a
parameter (``broadcast``, ``all_reduce``), nor an in-place kernel still running on another thread
at the instant the copy ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer_client._staging import Gate
from trainer_client.errors import TornSnapshot

log = logging.getLogger("strata.client")

Key = tuple[int, int]


def tensor_key(t: torch.Tensor) -> Key:
    return (t.data_ptr(), t.numel() * t.element_size())


@dataclass
class Deferral:
    """The tensors (by index into the flat list) a save copies in the background, with the
    version counter each had at ``save()`` and the optimizer that vouches for it."""

    indices: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    owners: list[torch.optim.Optimizer] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.indices)


class Overlap:
    """The optimizers registered for overlapped staging, their hooks, and the proof."""

    def __init__(self, after_step: Callable[[], None]) -> None:
        self.gate = Gate()
        #: the optimizers registered, as given
        self.optimizers: list[torch.optim.Optimizer] = []
        self._after_step = after_step
        self._handles: list[Any] = []
        #: ids of the optimizers (given or wrapped) whose pre-hook waits on the gate
        self._gated: set[int] = set()
        #: ids of the optimizers whose tensors are copied in save() after a torn save
        self._distrusted: set[int] = set()
        self._told: set[int] = set()

    def register(self, optimizer: torch.optim.Optimizer) -> None:
        if any(optimizer is known for known in self.optimizers):
            return
        self.optimizers.append(optimizer)
        warmed = False
        for opt in _walk(optimizer):
            if id(opt) in self._gated:
                continue
            try:
                self._handles.append(opt.register_step_pre_hook(lambda *_: self.gate.wait()))
            except AttributeError:  # its __init__ never made a hook table: nothing is deferred
                continue
            self._gated.add(id(opt))
            # Warm once the outermost step that runs its hooks is over (lazy state then exists).
            if not warmed and _hooks_run(opt):
                self._handles.append(opt.register_step_post_hook(lambda *_: self._after_step()))
                warmed = True

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def plan(
        self,
        tensors: list[tuple[str, torch.Tensor]],
        optimizers: Iterable[torch.optim.Optimizer],
        modules: Iterable[torch.nn.Module],
    ) -> Deferral:
        """Which of ``tensors`` this save may copy in the background; ``optimizers`` and
        ``modules`` are those of the saved state (an unregistered optimizer proves nothing)."""
        owner: dict[Key, torch.optim.Optimizer] = {}
        blocked: set[int] = set()  # storages something unproven may write
        for top in self.optimizers:
            for leaf in _leaves(top):
                held = list(_tensors_of(leaf))
                if self._trusted(leaf):
                    for t in held:
                        owner.setdefault(tensor_key(t), leaf)
                else:
                    blocked.update(_storage(t) for t in held)
        registered = {id(o) for o in self.optimizers}
        for top in optimizers:
            if id(top) not in registered:
                blocked.update(_storage(t) for leaf in _leaves(top) for t in _tensors_of(leaf))
        blocked.update(_storage(t) for t in _mutated_outside_step(modules))
        out = Deferral()
        if not owner:
            return out
        for i, (_, t) in enumerate(tensors):
            vouch = owner.get(tensor_key(t))
            if vouch is not None and _storage(t) not in blocked:
                out.indices.append(i)
                out.versions.append(t._version)
                out.owners.append(vouch)
        return out

    def verify(self, deferral: Deferral, tensors: list[tuple[str, torch.Tensor]], step: int) -> None:
        """Raise :class:`TornSnapshot` if a deferred tensor changed since ``save()``. Called once
        its copy is done and before the gate opens (so no step of a gated optimizer ran)."""
        changed = [
            (tensors[i][0], leaf)
            for i, version, leaf in zip(deferral.indices, deferral.versions, deferral.owners, strict=True)
            if tensors[i][1]._version != version
        ]
        if not changed:
            return
        for _, leaf in changed:
            if id(leaf) not in self._distrusted:
                self._distrusted.add(id(leaf))
                log.warning(
                    "overlapped staging: a tensor of %s changed outside its step() between save() and "
                    "its next step; its tensors are copied inside save() from now on",
                    type(leaf).__name__,
                )
        name, leaf = changed[0]
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise TornSnapshot(
            f"step {step} not saved: {name!r}{more} changed in place between save() and the end of "
            f"its background copy, outside {type(leaf).__name__}.step(); the staged bytes are not the "
            "state at save(), so nothing was committed"
        )

    def _trusted(self, leaf: torch.optim.Optimizer) -> bool:
        ok = id(leaf) in self._gated and id(leaf) not in self._distrusted and _hooks_run(leaf)
        if not ok and id(leaf) not in self._told:
            self._told.add(id(leaf))
            log.info(
                "overlapped staging: %s's step hooks are not known to run; its tensors are copied "
                "inside save()",
                type(leaf).__name__,
            )
        return ok


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no plain storage (sparse, nested): its own address
        return t.data_ptr()


def _hooks_run(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` runs its step hooks: torch wraps a class's ``step`` with its hook
    dispatcher (and marks it ``hooked``) in ``Optimizer.__init__``; a subclass that skips it
    (TorchRec's KeyedOptimizer) keeps an unwrapped step whose hooks never run."""
    if not getattr(getattr(type(opt), "step", None), "hooked", False):
        return False
    if not isinstance(vars(opt).get("_optimizer_step_pre_hooks"), dict):
        return False
    # Replaced on the instance: only an LR scheduler's wrapper of the class's own (hooked) step
    # is known to reach the hooks before anything else runs; a wrapper of a wrapper is not.
    own = vars(opt).get("step")
    return own is None or (
        bool(getattr(own, "_wrapped_by_lr_sched", False))
        and getattr(own, "__wrapped__", None) is type(opt).step
    )


def _inner(opt: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers a wrapper's step() delegates to (TorchRec's wrappers), else []."""
    attrs = vars(opt)
    combined = attrs.get("_optims")
    if isinstance(combined, list):
        return [
            o
            for item in combined
            for o in (item[1] if isinstance(item, tuple) else item,)
            if isinstance(o, torch.optim.Optimizer)
        ]
    wrapped = attrs.get("_optimizer")
    return [wrapped] if isinstance(wrapped, torch.optim.Optimizer) else []


def _walk(opt: torch.optim.Optimizer) -> Iterator[torch.optim.Optimizer]:
    """``opt`` and every optimizer it wraps, outermost first."""
    seen: set[int] = set()
    todo = [opt]
    while todo:
        o = todo.pop(0)
        if id(o) not in seen:
            seen.add(id(o))
            yield o
            todo.extend(_inner(o))


def _leaves(opt: torch.optim.Optimizer) -> Iterator[torch.optim.Optimizer]:
    return (o for o in _walk(opt) if not _inner(o))


def _tensors_of(opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters and state tensors ``opt`` may update."""
    for group in opt.param_groups:
        yield from (p for p in group["params"] if isinstance(p, torch.Tensor))
    params = vars(opt).get("params")  # a KeyedOptimizer's by name
    if isinstance(params, Mapping):
        yield from (p for p in params.values() if isinstance(p, torch.Tensor))
    for key, per_param in opt.state.items():
        if isinstance(key, torch.Tensor):
            yield key
        if isinstance(per_param, Mapping):
            yield from (v for v in per_param.values() if isinstance(v, torch.Tensor))


_FUSED: dict[type, bool] = {}


def _fused(cls: type) -> bool:
    """An fbgemm module, or a TorchRec module with a fused optimizer (by name: TorchRec is optional)."""
    found = _FUSED.get(cls)
    if found is None:
        found = _FUSED[cls] = cls.__module__.startswith("fbgemm_gpu") or any(
            c.__name__ == "FusedOptimizerModule" for c in cls.__mro__
        )
    return found


def _mutated_outside_step(modules: Iterable[torch.nn.Module]) -> Iterator[torch.Tensor]:
    """Tensors of ``modules`` that forward or backward change in place."""
    for module in modules:
        for sub in module.modules():
            if _fused(type(sub)):
                # fbgemm's TBE updates tables (and their optimizer state) inside backward.
                yield from sub.parameters()
                yield from sub.buffers()
                fused = getattr(sub, "fused_optimizer", None)
                fused = fused() if callable(fused) else fused
                if isinstance(fused, torch.optim.Optimizer):
                    yield from (t for leaf in _leaves(fused) for t in _tensors_of(leaf))
                continue
            weight = getattr(sub, "weight", None)
            if getattr(sub, "max_norm", None) is not None and isinstance(weight, torch.Tensor):
                yield weight  # Embedding(max_norm=...) renormalises rows in forward
            for p in sub.parameters(recurse=False):
                if getattr(p, "_in_backward_optimizers", None):
                    yield p  # stepped inside backward
