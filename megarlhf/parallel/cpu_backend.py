"""The CPU backend: lets megatron-core's CUDA-only paths run on CPU over gloo.

megatron-core's pipeline schedules, DDP buffers, distributed optimizer, gradient
clipping and checkpoint saving allocate on ``"cuda"`` / ``torch.cuda.current_device()``,
call ``torch.cuda.synchronize()`` and test ``param.type() == 'torch.cuda.FloatTensor'``.
On a machine without CUDA this module redirects exactly those four things (measured
against megarlhf's pin, megatron-core 0.16.1; docs/design.md):

1. ``torch.cuda.current_device()`` returns the CPU device;
2. a ``TorchFunctionMode`` rewrites ``device="cuda..."`` arguments to CPU;
3. ``torch.cuda.synchronize()`` is a no-op;
4. inside that mode ``Tensor.type()`` reports the CUDA type name and ``Tensor.cuda()``
   is the identity;
5. activation recomputation (``tensor_parallel.checkpoint``, ``CheckpointWithoutOutput``)
   saves the CUDA generator's state before a forward and restores it for the recomputed
   one: there is no CUDA generator here, so megatron's ``_get_cuda_rng_state`` returns an
   empty state and ``_set_cuda_rng_state`` takes it. Dropout on CPU tensors draws from
   the CPU generator, whose state megatron saves and restores itself (``torch.get_rng_state``),
   so a recomputed forward draws what the first one drew;
6. megatron's tracker of named generator states (``get_cuda_rng_tracker``: the
   tensor-parallel state that sequence parallelism's dropout forks into, the expert
   state) keeps CPU generator states: :class:`CpuRNGStatesTracker` seeds them as
   megatron's ``model_parallel_cuda_manual_seed`` does, and a fork swaps the CPU
   generator to the named state and back (recomputation saves and restores them as on
   CUDA);
7. context parallelism's rotary embedding (``get_pos_emb_on_this_cp_rank``, used by
   megatron's rotary embeddings) builds its chunk index in pinned host memory and moves
   it to CUDA: :func:`_pos_emb_on_this_cp_rank` takes the same chunks on the embedding's
   own device.

1, 3, 5, 6 and 7 are process-wide once :func:`activate` ran. The mode (2 and 4) costs a Python call
per torch call, so it is entered only at megatron-core's doors - :func:`at_megatron` on
the engine's entry points: building a role (model, DDP, optimizer), the pipeline
schedules, the optimizer's step, checkpoint save and load, resharding into the inference
model. Inside those, :func:`suspended` lifts it again around code that names no device
(the model's forward in a schedule, the loss functions, megatron's backward). Code outside
the engine (sampling, scoring's arithmetic, the PPO update's batching) never runs under
it and never mentions it.

It is the only place in megarlhf that special-cases CPU for megatron-core's sake, and
it activates only when CUDA is absent. ``tests/test_cpu_backend.py`` fails loudly if
the pinned megatron-core changes.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

PINNED_MEGATRON_CORE = "0.16.1"

_CPU = torch.device("cpu")
_state = {"mode": None, "saved": {}}  # mode: the TorchFunctionMode, once activated


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _cuda_type_name(tensor: torch.Tensor) -> str:
    # 'torch.FloatTensor' -> 'torch.cuda.FloatTensor', as megatron's optimizers expect.
    name = torch.Tensor.type(tensor)
    return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name


_SPECIAL = frozenset((torch.Tensor.type, torch.Tensor.cuda, torch.Tensor.to))


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call under the mode passes here: the common case (no keyword
        # arguments, none of the three methods) returns at once.
        if func in _SPECIAL:
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                with torch._C.DisableTorchFunction():
                    return _cuda_type_name(args[0])
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], _CPU, *args[2:])
        if not kwargs:
            return func(*args)
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        return func(*args, **kwargs)


def _current_device():
    return _CPU


def _synchronize(device=None):
    return None


def needed() -> bool:
    """True when megatron-core's CUDA paths must be redirected (no CUDA here)."""
    return not torch.cuda.is_available()


def is_active() -> bool:
    """Whether the redirections are installed (:func:`activate` ran; no CUDA here)."""
    return _state["mode"] is not None


def activate() -> bool:
    """Install redirections 1 and 3 if CUDA is absent, and make :func:`at_megatron` enter
    the mode. Idempotent; returns whether active."""
    if not needed():
        return False
    if is_active():
        return True
    _state["saved"] = {
        "current_device": torch.cuda.current_device,
        "synchronize": torch.cuda.synchronize,
    }
    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = _synchronize
    _state["mode"] = _CudaToCpuMode()
    _suspend_in_backward()
    _no_cuda_generator()
    _cpu_rng_tracker()
    _cp_rotary()
    return True


def _on_top(mode) -> bool:
    depth = torch._C._len_torch_function_stack()
    return depth > 0 and torch._C._get_function_stack_at(depth - 1) is mode


@contextlib.contextmanager
def at_megatron():
    """Run the body under the mode (redirections 2 and 4): around a call into megatron-core
    that allocates on ``"cuda"`` or checks CUDA tensor types. A no-op with CUDA, before
    :func:`activate`, and when the mode is already on (a door inside a door)."""
    mode = _state["mode"]
    if mode is None or _on_top(mode):
        yield
        return
    with mode:
        yield


def _suspend_in_backward() -> None:
    """Run megatron's ``backward_step`` (the schedules' backward through the model, DDP's
    gradient hooks included) without the mode: its Python autograd functions name no
    device, and under the mode each of their torch calls costs about 2 us more (6% of a
    tiny-model PPO iteration)."""
    from megatron.core.pipeline_parallel import schedules

    original = schedules.backward_step
    _state["saved"]["backward_step"] = original

    def backward_step(*args, **kwargs):
        with suspended():
            return original(*args, **kwargs)

    schedules.backward_step = backward_step


def _no_cuda_generator() -> None:
    """Redirection 5: megatron's recomputation saves and restores a CUDA generator's state
    that does not exist on this machine (the CPU generator's it handles itself)."""
    from megatron.core.tensor_parallel import random

    _state["saved"]["rng"] = (random._get_cuda_rng_state, random._set_cuda_rng_state)

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.empty(0, dtype=torch.uint8)

    def set_state(new_state, device=-1, graph_safe=False):
        return None

    random._get_cuda_rng_state, random._set_cuda_rng_state = get_state, set_state


class CpuRNGStatesTracker:
    """Redirection 6: megatron's ``CudaRNGStatesTracker`` over the CPU generator (made a
    subclass of it when installed, :func:`_cpu_rng_tracker`). A named state is a CPU
    generator state seeded from the name's seed; ``fork`` runs its body on that state,
    keeps where it got to, and puts the generator back where it was."""

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _cpu_rng_tracker() -> None:
    """Redirection 6: megatron builds its tracker from the module's
    ``CudaRNGStatesTracker`` when first asked (or reset): the CPU one in its place."""
    from megatron.core.tensor_parallel import random

    original = random.CudaRNGStatesTracker
    _state["saved"]["tracker"] = original
    random.CudaRNGStatesTracker = type("CpuRNGStatesTracker",
                                       (CpuRNGStatesTracker, original), {})
    random.initialize_rng_tracker(force_reset=True)


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim: int, cp_group):
    """Redirection 7: megatron's ``get_pos_emb_on_this_cp_rank`` - chunks ``cp_rank`` and
    ``2 cp - 1 - cp_rank`` of 2 x CP along ``seq_dim`` - with the index on
    ``pos_emb``'s device."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp, rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([rank, 2 * cp - rank - 1], device=pos_emb.device)
    shaped = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1:])
    picked = shaped.index_select(seq_dim, index)
    return picked.view(*picked.shape[:seq_dim], -1, *picked.shape[seq_dim + 2:])


def _cp_rotary() -> None:
    """Redirection 7, in the modules that call it."""
    from megatron.core.models.common.embeddings import (rotary_pos_embedding,
                                                        yarn_rotary_pos_embedding)

    _state["saved"]["cp_rotary"] = rotary_pos_embedding.get_pos_emb_on_this_cp_rank
    for module in (rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank


def deactivate() -> None:
    """Undo :func:`activate` (used by tests)."""
    mode = _state["mode"]
    if mode is None:
        return
    torch.cuda.current_device = _state["saved"]["current_device"]
    torch.cuda.synchronize = _state["saved"]["synchronize"]
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random
    schedules.backward_step = _state["saved"]["backward_step"]
    random._get_cuda_rng_state, random._set_cuda_rng_state = _state["saved"]["rng"]
    random.CudaRNGStatesTracker = _state["saved"]["tracker"]
    random.initialize_rng_tracker(force_reset=True)
    from megatron.core.models.common.embeddings import (rotary_pos_embedding,
                                                        yarn_rotary_pos_embedding)
    for module in (rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = _state["saved"]["cp_rotary"]
    _state["mode"] = None


@contextlib.contextmanager
def suspended():
    """Run the body without the ``TorchFunctionMode`` (redirections 1 and 3 stay): inside
    an :func:`at_megatron` door, around code that names no ``"cuda"`` device.

    Every torch call under the mode is dispatched through Python, which costs more than
    the op itself for the small tensors of CPU runs. The model's forward in a schedule, the
    loss functions and megatron's backward name no device, so the engine suspends the mode
    around them; megatron's schedules, DDP and optimizer code around them still run under
    it. Outside a door there is nothing to lift: a no-op."""
    mode = _state["mode"]
    if mode is None or not _on_top(mode):
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield
