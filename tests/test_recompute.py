"""Activation recomputation (issue 57, item 1): megatron-core's full (uniform and block) and
selective recomputation, set per role by ``model.recompute``, on the CPU path too.

The multi-rank worker (``workers/recompute_paths.py``) trains a tiny llama at TP=2 and at
PP=2 - one PPO policy update and one SFT step, padded and packed - with each setting, and
compares every gradient with the same run keeping every activation. It also measures the
bytes autograd keeps for backward: a setting that is not passed on to megatron would
match the gradients too, and only the memory shows it.
"""

import os

import pytest
import torch

from conftest import WORKERS, torchrun
from megarlhf.config import ConfigError, load_config

FAST = "none full_uniform_1 selective_mlp dropout dropout_full"


def _results(tmp_path, variants: str | None, world: int = 2) -> dict:
    env = {"MEGARLHF_SPEEDUPS": "-positions"}  # see test_recomputation_keeps_the_numbers
    if variants:
        env["RECOMPUTE_VARIANTS"] = variants
    torchrun(os.path.join(WORKERS, "recompute_paths.py"), world, str(tmp_path), env=env)
    return torch.load(tmp_path / f"recompute_world{world}.pt", weights_only=False)


def _check(results: dict) -> None:
    for key, run in results.items():
        assert run["grad_gap"] < 1e-6, (key, run["grad_gap"])
    for tp, pp, name, stage, packed in results:
        run = results[(tp, pp, name, stage, packed)]
        base = results[(tp, pp, "dropout" if name.startswith("dropout") else "none", stage,
                        packed)]
        for log, value in run["logs"].items():  # the forward pass is the same arithmetic
            assert abs(float(value) - float(base["logs"][log])) <= 1e-6 * max(
                1.0, abs(float(value))), (tp, pp, name, stage, packed, log)
        saved, plain = run["saved"], base["saved"]
        if name in ("full_uniform_1", "dropout_full"):  # only each layer's input kept
            assert saved < 0.45 * plain, (tp, pp, name, stage, packed, saved, plain)
        elif name == "full_uniform_2":  # every other layer's input kept
            assert saved < 0.75 * plain, (tp, pp, name, stage, packed, saved, plain)
        elif name == "full_block_1":  # one of a stage's 4 (TP=2) or 2 (PP=2) layers
            assert saved < 0.9 * plain, (tp, pp, name, stage, packed, saved, plain)
        elif name == "selective_mlp" and not packed:  # the MLP's inner activations
            assert saved < 0.8 * plain, (tp, pp, name, stage, packed, saved, plain)


def test_recomputation_keeps_the_numbers_and_drops_activations(tmp_path):
    """Full recomputation (groups of one layer), selective (core attention and the MLP),
    and full with dropout 0.1, in one process (the extended test: TP=2 and PP=2, blocks,
    groups of two):
    losses and gradients within 1e-6 of keeping every activation (with dropout: the
    recomputed forward draws the masks the first one drew - the CPU backend's RNG
    redirection), and the bytes kept for backward lower (full, groups of one: below 45%).
    The positions speed-up is off: without recomputation it cuts the last MLP to the loss's
    positions, so a run with dropout would draw fewer numbers there than one with it."""
    _check(_results(tmp_path, FAST, world=1))


@pytest.mark.extended
@pytest.mark.slow
def test_every_recomputation_setting_keeps_the_numbers(tmp_path):
    """Every setting at TP=2 and at PP=2: FAST plus groups of two layers, the first layer
    of each stage as a block, and core attention alone (whose memory megarlhf's SDPA
    attention does not lower: its kernels keep no score matrix to drop)."""
    _check(_results(tmp_path, None))


def _layout_error(overrides: list[str]) -> str:
    from megarlhf.config import check_model_layout
    cfg = load_config(None, ["model.num_layers=4", "model.hidden_size=64",
                             "model.num_attention_heads=4", *overrides])
    with pytest.raises((ConfigError, ValueError)) as err:
        check_model_layout("parallel", cfg.model, cfg.parallel.layout)
    return str(err.value)


def test_recomputation_settings_that_cannot_work_are_refused():
    """Before any work, naming the setting: a uniform group that does not divide a
    pipeline chunk's layers, a block longer than a chunk, an unknown module, a module the
    model does not have, and (without TransformerEngine) megatron-core 0.16.1's layernorm
    recomputation."""
    assert "must divide the 2 layers of each pipeline chunk" in _layout_error(
        ["model.recompute.granularity=full", "model.recompute.num_layers=3",
         "parallel.pipeline_model_parallel_size=2"])
    assert "must be at most the 2 layers" in _layout_error(
        ["model.recompute.granularity=full", "model.recompute.method=block",
         "model.recompute.num_layers=3", "parallel.pipeline_model_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"model.recompute.modules=.*unknown modules \['attn'\]"):
        load_config(None, ["model.recompute.granularity=selective",
                           "model.recompute.modules=[attn]"])
    with pytest.raises(ConfigError, match="recomputes moe, which this model does not have"):
        load_config(None, ["model.recompute.granularity=selective",
                           "model.recompute.modules=[moe]"])
    with pytest.raises(ConfigError, match="moe_act, which needs grouped GEMM"):
        load_config(None, ["model.recompute.granularity=selective",
                           "model.recompute.modules=[moe_act]", "model.moe.num_experts=4"])
    from megarlhf.models.spec import resolve_impl, transformer_engine_available
    if not transformer_engine_available():
        cfg = load_config(None, ["model.recompute.granularity=selective",
                                 "model.recompute.modules=[core_attn,layernorm]"])
        with pytest.raises(ValueError, match="layernorm recomputation needs TransformerEngine"):
            resolve_impl(cfg.model)


def test_recomputation_reaches_megatrons_config():
    """The role's TransformerConfig carries the setting (what the worker's memory shows
    working), and per role: roles.critic.model.recompute leaves the actor's alone."""
    from megarlhf.config import Layout
    from megarlhf.models.gpt import transformer_config
    base = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4"]
    full = load_config(None, [*base, "model.recompute.granularity=full",
                              "model.recompute.method=block", "model.recompute.num_layers=2"])
    config = transformer_config(full.model, Layout())
    assert (config.recompute_granularity, config.recompute_method,
            config.recompute_num_layers) == ("full", "block", 2)
    selective = load_config(None, [*base, "model.recompute.granularity=selective",
                                   "model.recompute.modules=[mlp]"])
    config = transformer_config(selective.model, Layout())
    assert config.recompute_granularity == "selective" and config.recompute_modules == ["mlp"]
    assert transformer_config(load_config(None, base).model, Layout()).recompute_granularity \
        is None
    from megarlhf.config import read_config
    from megarlhf.roles.spec import ppo_role_specs
    cfg, written = read_config(None, [*base, "model.vocab_size=300", "rollout.rewards.fn=a:b",
                                      "ppo.critic_init=sft",
                                      "roles.critic.model.recompute.granularity=full"])
    specs = ppo_role_specs(cfg, 1, written=written, planning=True)
    assert {name: spec.model.recompute.granularity for name, spec in specs.items()} == \
        {"actor": None, "reference": None, "critic": "full"}
