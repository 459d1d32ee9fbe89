"""A CUDA graph's contract, checked on the CPU: a replay does exactly what the capture recorded.

A CUDA graph replays the kernels its capture launched, with the same arguments: the same tensors
at the same addresses, the same shapes and the same Python numbers. A captured function that reads
a tensor made anew for each request, or slices by a count that changes between calls, computes
right when it runs eagerly and wrong when replayed. On the CPU ``ragkv.gpu.graphs`` runs its
functions again instead of replaying them (``_Eager``), so that mistake would pass every CPU test.

:func:`strict_eager` is a drop-in for ``ragkv.gpu.graphs._eager`` that records every ATen call a
function makes when it is "captured" (its run after a warm-up, as a CUDA capture follows one) and
again at each replay, and fails the replay where the two differ. Tensors are described by where their
memory comes from: one the function made itself (a temporary: from the graph's private pool on a
GPU, so its address is the graph's own) by its shape, strides and dtype; any other (a static
buffer, a weight) by its address as well, and a host scalar by its value. A call that reads the
device back (``.item()``, ``nonzero``, ...) fails at once: a capture cannot hold it.

What a CPU run cannot see: copies between host and device (there is only the host), page-locked
memory, and kernels called outside ATen (ragkv's own CPU kernels through ctypes); the CUDA tests
capture real graphs for those.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

Call = tuple[Any, Any]  # (the ATen operator, its arguments described)


class GraphContractError(AssertionError):
    """A replay did not do what its capture recorded: a CUDA graph would have computed something else."""


# ATen calls that read a device tensor back to the host: a CUDA capture fails on them
_SYNCING = frozenset(
    {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "equal", "is_nonzero"}
)


class _Recorder(TorchDispatchMode):
    """Every ATen call made under it, its tensors described as in the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self.outside: list[torch.Tensor] = []  # the tensors first met as an argument (kept by the capture)
        self._made: set[int] = set()  # storages an operator returned before any call read them
        self._outside: set[int] = set()  # storages first met as an argument

    def _describe(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        storage = x.untyped_storage().data_ptr()
        layout = (tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, x.device)
        if storage in self._made:
            return ("made", *layout)
        if storage not in self._outside:
            self._outside.add(storage)
            self.outside.append(x)
        if x.dim() == 0 and x.device.type == "cpu":  # a host scalar: a graph keeps its value, not its address
            return ("at", storage, *layout, x.item())
        return ("at", storage, *layout)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in _SYNCING:
            raise GraphContractError(f"{func} reads the device back to the host: a CUDA capture fails on it")
        described = tree_map(self._describe, (args, kwargs))
        out = func(*args, **kwargs)
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage().data_ptr()
                if storage not in self._outside:
                    self._made.add(storage)
        self.calls.append((func, described))
        return out


def record(fn: Callable[[], None]) -> list[Call]:
    """Run ``fn`` once and return the ATen calls it made."""
    return _recorded(fn).calls


def _recorded(fn: Callable[[], None]) -> _Recorder:
    with _Recorder() as recorder:
        fn()
    return recorder


class StrictReplay:
    """A "graph" that runs its function again and checks that it did what its first run did.

    Each replay runs in the inference mode its capture ran in: a CUDA graph replays the kernels it
    captured whatever the mode, while on the CPU the mode changes which ATen calls a function makes
    (``rms_norm`` runs whole in inference mode and as its parts outside it).
    """

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.inference, self.grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        fn()  # the warm-up, as before a CUDA capture: state made lazily on a first run is made here
        capture = _recorded(fn)
        self.captured = capture.calls
        # what the capture read stays alive, as a graph keeps it: a tensor made for a later call
        # cannot land at its address and pass for it
        self.kept = capture.outside
        self.replays = 0

    def replay(self) -> None:
        # leaving inference mode turns grad mode on: set it back as the capture had it
        with torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad):
            got = record(self.fn)
        self.replays += 1
        if got == self.captured:
            return
        for i, (want, have) in enumerate(zip(self.captured, got, strict=False)):
            if want != have:
                raise GraphContractError(f"call {i} of the replay differs from the capture's:\n  {want}\n  {have}")
        raise GraphContractError(f"the capture made {len(self.captured)} calls, the replay {len(got)}")


def strict_eager(fns: Sequence[Callable[[], None]]) -> list[StrictReplay]:
    """``ragkv.gpu.graphs._eager`` with every replay checked against its capture."""
    return [StrictReplay(fn) for fn in fns]
