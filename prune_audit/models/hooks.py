"""Reading a module's inputs during one call, on a model that other threads may be running at the same time.

A loaded model is shared: the Python API lets several threads answer on one ``load()`` result, and their
forwards run through the same ``nn.Module`` objects. A forward hook is registered on the shared module, so
it sees every thread's forward; :func:`capture_inputs` therefore keeps only the inputs of the thread that
opened it, and only while it is open, and removes its hooks on every way out (a return, an exception, a
``KeyboardInterrupt`` at any line): a hook left behind would slow every later forward and keep alive the
tensors it captured.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

Inputs = list[tuple[tuple[Any, ...], dict[str, Any]]]


class _Captured(list):
    """One call's captured ``(args, kwargs)`` (a list subclass, so that its hooks can watch it weakly)."""


@contextmanager
def capture_inputs(modules: Sequence[nn.Module]) -> Iterator[Inputs]:
    """Inside the block, the list of ``(args, kwargs)`` each of ``modules`` receives in this thread, in call order.

    Forwards of other threads through the same modules are not captured. The hooks are removed when the block
    exits, however it exits; should an interrupt cut that removal itself short, the hooks left are inert once the
    block is closed or its list is gone, and each removes its call's hooks the next time a forward reaches it.
    """
    owner = threading.get_ident()
    captured = _Captured()
    alive = weakref.ref(captured)  # the hooks hold no strong reference: an abandoned call's list can die
    closed: list[bool] = []
    handles: list[RemovableHandle] = []

    def keep(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
        # kwargs defaults: another thread's forward that listed this hook before its removal calls it without them
        inputs = alive()
        if closed or inputs is None:
            _remove(handles)
        elif threading.get_ident() == owner:
            inputs.append((args, kwargs or {}))

    try:
        for module in modules:
            handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
        yield captured
    finally:
        closed.append(True)
        _remove(handles)


def _remove(handles: Sequence[RemovableHandle]) -> None:
    """Remove every handle (removing one twice is harmless)."""
    for handle in handles:
        handle.remove()


__all__ = ["capture_inputs"]
