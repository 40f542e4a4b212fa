"""One checkpoint format for the optimizer state of both of megatron's optimizers.

The distributed optimizer's ``fully_reshardable`` format keeps, per model parameter, its
fp32 main weight and Adam moments as tensors of the parameter's own shape and sharding
(``optimizer.state.{param,exp_avg,exp_avg_sq}.<parameter key>``), and the step in the
param groups. It loads at any TP, PP and DP. The plain (non-sharded) optimizer writes and
reads that same format here, so a checkpoint saved by either loads into either: a run at
DP=1 (plain optimizer, ``optimizer.use_distributed_optimizer=auto``) resumes at DP=2
(distributed) and back. megatron's own plain format (``optimizer.state.exp_avg...`` with a
``common_step``) is still read for checkpoints written before this format existed.

A mixture-of-experts model's optimizer is megatron's chain of two (dense and expert
parameters, which are reduced over different data-parallel groups) wherever EP > 1 or the
optimizer is distributed. The tensors are stored under the same names either way (the
chain adds no prefix: ``chained_optim_avoid_prefix``), and the parts that are not tensors
(the parameter groups and their step) are rebuilt for the optimizer that loads when the
chain that saved them was another: a run at EP=2 resumes at EP=1 and back.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megarlhf.engine.optimizer import ensure_optimizer_state
from megarlhf import speedups
from megarlhf.speedups import fused_adam

FORMAT = "fully_reshardable"
METADATA = {"distrib_optim_sharding_type": FORMAT}  # for the distributed optimizer
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


def sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_distributed(optimizer) -> bool:
    return any(isinstance(opt, DistributedOptimizer) for opt in sub_optimizers(optimizer))


def _param_pairs(opt) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(model parameter, the fp32 main parameter Adam updates), in the optimizer's order."""
    if hasattr(opt, "float16_groups"):  # bf16/fp16 weights with fp32 masters
        for low, masters, fp32 in zip(opt.float16_groups, opt.fp32_from_float16_groups,
                                      opt.fp32_from_fp32_groups):
            yield from zip(low, masters)
            yield from ((p, p) for p in fp32)
    else:
        for group in opt.optimizer.param_groups:
            yield from ((p, p) for p in group["params"])


def _step_of(inner: torch.optim.Optimizer) -> float:
    steps = {float(state["step"]) for state in inner.state.values() if "step" in state}
    if len(steps) > 1:
        raise ValueError(f"the optimizer's step differs per parameter ({sorted(steps)})")
    return steps.pop() if steps else 0.0


def sharded_optimizer_state(optimizer, model_sharded: dict, *, loading: bool) -> dict:
    """The optimizer's entry of a sharded checkpoint state, in the one format (a chain's:
    one entry per sub-optimizer, keyed by its index)."""
    if is_distributed(optimizer):
        # loading: a fresh optimizer has no state to load into; saving: one whose every
        # step was skipped has none to save
        ensure_optimizer_state(optimizer)
        return optimizer.sharded_state_dict(model_sharded, is_loading=loading,
                                            metadata={**METADATA,
                                                      "chained_optim_avoid_prefix": True})
    subs = sub_optimizers(optimizer)
    if len(subs) == 1:
        return _plain_state(subs[0], model_sharded, loading)
    return {i: _plain_state(sub, model_sharded, loading) for i, sub in enumerate(subs)}


def _plain_state(opt, model_sharded: dict, loading: bool) -> dict:
    inner = opt.optimizer
    opt.init_state_fn(inner, opt.config)  # zero moments where a parameter has none yet
    tensors, _ = extract_sharded_tensors_and_factories(model_sharded)
    by_param = {sh.data: sh for sh in nested_values(tensors)}
    param_state = {}
    for index, (model_param, main_param) in enumerate(_param_pairs(opt)):
        state = inner.state[main_param]
        values = {"param": main_param.detach(), "exp_avg": state["exp_avg"],
                  "exp_avg_sq": state["exp_avg_sq"]}
        if loading:  # loaded into fresh tensors, copied in by load_optimizer_state
            values = {k: torch.empty_like(v) for k, v in values.items()}
        param_state[index] = {
            key: make_sharded_optimizer_tensor(by_param[model_param], value,
                                               prefix=f"optimizer.state.{key}")
            for key, value in values.items()}
    step = _step_of(inner)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": step}
              for g in inner.param_groups]
    return {"optimizer": {"param_groups": groups}, "param_state": param_state,
            "param_state_sharding_type": FORMAT}


def legacy_plain_state(optimizer, model_sharded: dict, *, loading: bool) -> dict:
    """megatron's own plain-optimizer format (checkpoints written before this module)."""
    return optimizer.sharded_state_dict(model_sharded, is_loading=loading)


@torch.no_grad()
def load_optimizer_state(optimizer, loaded: dict, *, legacy: bool = False) -> None:
    """Put a loaded optimizer entry (see ``sharded_optimizer_state``) into ``optimizer``;
    afterwards torch's fused Adam kernel again (loading restores the saved group flags)."""
    if legacy:
        _keep_torch_adam_step(optimizer)
        optimizer.load_state_dict(loaded)
        _unshare_torch_adam_step(optimizer)
    else:
        subs = sub_optimizers(optimizer)
        parts = _entries(subs, loaded)
        if is_distributed(optimizer):
            _keep_torch_adam_step(optimizer)
            optimizer.load_state_dict(parts[0] if len(subs) == 1 else dict(enumerate(parts)))
            _unshare_torch_adam_step(optimizer)
        else:
            for sub, part in zip(subs, parts):
                _load_plain(sub, part)
    if speedups.enabled("fused_adam"):
        fused_adam.use_fused_torch_adam(optimizer)


def _entries(subs: list, loaded: dict) -> list[dict]:
    """One loaded entry per sub-optimizer of ``subs``. The tensors are where this
    optimizer's own sharded state put them; the parameter groups come from the file, where
    the saving optimizer kept them - a chain of another length keeps them elsewhere, and
    then they are this optimizer's own, with the saved step."""
    saved = [loaded] if "param_state_sharding_type" in loaded else \
        [v for k, v in sorted((k, v) for k, v in loaded.items() if isinstance(k, int))]
    kinds = {part.get("param_state_sharding_type") for part in saved}
    if kinds != {FORMAT}:
        raise ValueError(f"the checkpoint's optimizer state is in format "
                         f"{sorted(map(str, kinds))}, not {FORMAT!r}")
    steps = {float(g["step"]) for part in saved
             for g in part.get("optimizer", {}).get("param_groups", []) if "step" in g}
    if len(steps) > 1:
        raise ValueError(f"the checkpoint's optimizer step differs per group ({steps})")
    step = steps.pop() if steps else 0.0
    mine = [loaded] if len(subs) == 1 else [loaded[i] for i in range(len(subs))]
    if len(saved) == len(subs):
        return [{**own, "optimizer": part["optimizer"], "param_state_sharding_type": FORMAT}
                for own, part in zip(mine, saved)]
    out = []
    for sub, own in zip(subs, mine):
        groups = sub.state_dict()["optimizer"]["param_groups"] if is_distributed(sub) else \
            [{k: v for k, v in g.items() if k != "params"} for g in sub.optimizer.param_groups]
        out.append({**own, "optimizer": {"param_groups": [{**g, "step": step} for g in groups]},
                    "param_state_sharding_type": FORMAT})
    return out


def _load_plain(opt, loaded: dict) -> None:
    inner = opt.optimizer
    steps = {float(g["step"]) for g in loaded["optimizer"]["param_groups"] if "step" in g}
    if len(steps) > 1:
        raise ValueError(f"the checkpoint's optimizer step differs per group ({steps})")
    step = steps.pop() if steps else 0.0
    for index, (model_param, main_param) in enumerate(_param_pairs(opt)):
        tensors: dict[str, Any] = loaded["param_state"][index]
        main_param.copy_(tensors["param"])
        if model_param is not main_param:
            model_param.copy_(main_param)
        state = inner.state[main_param]
        state["exp_avg"].copy_(tensors["exp_avg"])
        state["exp_avg_sq"].copy_(tensors["exp_avg_sq"])
        # each parameter its own step tensor: torch increments it in place
        state["step"] = torch.tensor(step, dtype=torch.float32, device=main_param.device)


def _keep_torch_adam_step(optimizer) -> None:
    """Work around megatron-core 0.16.1 without apex/TE: loading the ``fully_reshardable``
    format copies every state key of torch Adam, including ``step``, from tensors that
    never hold it (KeyError: 'step'). ``step`` is restored from the param groups just
    before, so the copy may keep it as it is."""
    for opt in sub_optimizers(optimizer):
        if not hasattr(opt, "_set_main_param_and_optimizer_states") \
                or getattr(opt, "_megarlhf_step_kept", False):
            continue  # nothing to patch, or patched by an earlier load
        original = opt._set_main_param_and_optimizer_states

        def patched(model_param, tensors, opt=opt, original=original):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
            state = opt.optimizer.state.get(main_param, {})
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
            return original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = patched
        opt._megarlhf_step_kept = True


def _unshare_torch_adam_step(optimizer) -> None:
    """megatron-core 0.16.1 without apex/TE gives every parameter's torch Adam state the
    *same* ``step`` tensor on load; torch increments it in place once per parameter, so
    the bias correction of resumed runs drifts. Give each parameter its own copy."""
    for opt in sub_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
