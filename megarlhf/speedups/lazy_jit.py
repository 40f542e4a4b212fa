"""Start-up: megatron's fusion kernels compiled on their first call, not at import.

Replaces: ``megatron.core.jit.jit_fuser`` (``torch.compile``, applied to each fusion kernel
as megatron's modules are imported) by one that compiles a kernel on its first call. The
first ``torch.compile`` imports torch's whole compiler stack: about 2 of every process's
5.5 s start-up on CPU, also where no fused kernel ever runs. Installed before megatron is
imported (the CLI's first step); too late, it does nothing.

Bitwise: yes (the same compiled kernels, compiled later).

Measured (2026-11-25, ``bench/speedups.py --size medium --startup``): a fresh process's
launch to its first checkpoint save of a medium PPO session 8.9 s with it, 10.7 s without
(20%).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys


class _LazyMegatronFuser(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """megatron-core decorates its fusion kernels with ``torch.compile`` as its modules are
    imported (``megatron.core.jit.jit_fuser``), and the first ``torch.compile`` imports
    torch's whole compiler stack: about 2 of every process's 5.5 s start-up on CPU, also
    where no fused kernel ever runs. This hook swaps ``jit_fuser``, as soon as
    ``megatron.core.jit`` is executed and before any module takes it, for one that calls
    ``torch.compile`` on a kernel's first call - when ``torch.compile`` compiles anyway."""

    NAME = "megatron.core.jit"

    def find_spec(self, name, path, target=None):
        if name != self.NAME:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        import torch

        if module.jit_fuser is torch.compile:
            module.jit_fuser = _compile_on_first_call


def _compile_on_first_call(fn):
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return call


def install() -> None:
    """Swap ``jit_fuser`` when ``megatron.core.jit`` is first imported (once)."""
    if "megatron.core.jit" not in sys.modules and \
            not any(isinstance(f, _LazyMegatronFuser) for f in sys.meta_path):
        sys.meta_path.insert(0, _LazyMegatronFuser())
