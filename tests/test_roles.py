"""Role resolution (no process group): each PPO role's checkpoint, model, layout and
optimizer, and every start-up error naming the role and the field. The checkpoints here
hold only the metadata the resolution reads; tests/test_ppo_roles.py runs real ones."""

import dataclasses
import json
import os

import pytest

from megarlhf.config import ConfigError, Layout, ModelConfig, load_config
from megarlhf.engine.checkpoint import META_FILE
from megarlhf.roles.spec import ppo_role_specs, single_role_spec

TOKENIZER = {"vocab_size": 43, "sha256": "abc"}


def checkpoint(tmp_path, name, role, kind, tokenizer=TOKENIZER, **model):
    """A checkpoint folder's metadata as ``save_checkpoint`` writes it."""
    folder = tmp_path / name
    folder.mkdir()
    shape = dataclasses.asdict(ModelConfig(**{"vocab_size": 43, "num_query_groups": 2,
                                              **model}))
    meta = {"tag": "step_1", "roles": {role: {"trained": True, "kind": kind, "model": shape,
                                              "tokenizer": tokenizer}},
            "trainer": {}, "config": {}, "layout": "TP=1 PP=1 DP=1", "world_size": 1}
    (folder / META_FILE).write_text(json.dumps(meta))
    return str(folder)


@pytest.fixture
def ckpts(tmp_path):
    return {"sft": checkpoint(tmp_path, "sft", "policy", "lm", num_layers=4, hidden_size=64),
            "rm": checkpoint(tmp_path, "rm", "reward", "value", num_layers=2, hidden_size=32)}


def ppo_cfg(ckpts, *extra):
    return load_config(None, [f"ppo.sft_checkpoint={ckpts['sft']}",
                              f"ppo.reward_checkpoint={ckpts['rm']}",
                              "parallel.make_vocab_size_divisible_by=16", *extra])


def test_models_come_from_each_checkpoint_and_layouts_from_the_actor(ckpts):
    cfg = ppo_cfg(ckpts, "parallel.tensor_model_parallel_size=2",
                  "optimizer.lr=1e-4", "optimizer.critic_lr=3e-4")
    specs = ppo_role_specs(cfg, 2, TOKENIZER)
    assert set(specs) == {"actor", "critic", "reference", "reward"}
    actor, reward, critic, ref = (specs[k] for k in ("actor", "reward", "critic", "reference"))
    assert (actor.model.num_layers, actor.model.hidden_size) == (4, 64)
    assert (reward.model.num_layers, reward.model.hidden_size) == (2, 32)
    assert (critic.model.num_layers, critic.model.hidden_size) == (2, 32)  # from the RM
    assert ref.model == actor.model and ref.checkpoint == actor.checkpoint
    assert all(s.layout == Layout(tp=2) for s in specs.values())
    assert actor.kind == ref.kind == "lm" and critic.kind == reward.kind == "value"
    assert actor.optimizer.lr == 1e-4 and critic.optimizer.lr == 3e-4
    assert ref.optimizer is None and reward.optimizer is None
    assert actor.padded_vocab == 64 and reward.padded_vocab == 64  # 43 -> 16 x lcm(TP)


def test_per_role_layouts_models_and_optimizers(ckpts):
    cfg = ppo_cfg(ckpts, "roles.actor.parallel.tensor_model_parallel_size=2",
                  "roles.critic.parallel.pipeline_model_parallel_size=2",
                  "roles.critic.parallel.tensor_model_parallel_size=1",
                  "roles.reference.parallel.tensor_model_parallel_size=1",
                  "roles.reward.model.params_dtype=bfloat16",
                  "roles.critic.optimizer.lr=2e-3",
                  "roles.critic.optimizer.use_distributed_optimizer=false",
                  "parallel.pipeline_model_parallel_size=1")
    specs = ppo_role_specs(cfg, 2, TOKENIZER)
    assert (specs["actor"].layout.tp, specs["actor"].layout.pp) == (2, 1)
    assert (specs["critic"].layout.tp, specs["critic"].layout.pp) == (1, 2)
    assert (specs["reference"].layout.tp, specs["reference"].layout.pp) == (1, 1)
    assert (specs["reward"].layout.tp, specs["reward"].layout.pp) == (2, 1)  # the actor's
    assert specs["reward"].model.params_dtype == "bfloat16"
    assert specs["reward"].model.num_layers == 2  # the rest from its checkpoint
    assert specs["critic"].optimizer.lr == 2e-3
    assert specs["critic"].optimizer.use_distributed_optimizer is False
    assert specs["actor"].optimizer.use_distributed_optimizer is False  # auto at DP=1
    assert specs["actor"].padded_vocab == 64  # actor TP 2 (and rollout TP 1)


def test_auto_optimizer_is_distributed_only_across_data_parallel_ranks(ckpts):
    # world 2: the actor at TP=1 has DP=2 (sharded), the critic at PP=2 has DP=1 (plain)
    specs = ppo_role_specs(ppo_cfg(ckpts, "parallel.tensor_model_parallel_size=1",
                                   "parallel.pipeline_model_parallel_size=1",
                                   "roles.critic.parallel.pipeline_model_parallel_size=2"),
                           2, TOKENIZER)
    assert specs["actor"].optimizer.use_distributed_optimizer is True
    assert specs["critic"].optimizer.use_distributed_optimizer is False
    assert "plain optimizer" in specs["critic"].describe()
    # an explicit choice stands at any DP
    specs = ppo_role_specs(ppo_cfg(ckpts, "parallel.tensor_model_parallel_size=1",
                                   "parallel.pipeline_model_parallel_size=1",
                                   "optimizer.use_distributed_optimizer=true"), 1, TOKENIZER)
    assert specs["actor"].optimizer.use_distributed_optimizer is True
    assert specs["critic"].optimizer.use_distributed_optimizer is True


def test_vpp_follows_the_actor_only_with_its_pipeline(ckpts):
    cfg = ppo_cfg(ckpts, "parallel.pipeline_model_parallel_size=2",
                  "parallel.virtual_pipeline_model_parallel_size=2",
                  "roles.reward.parallel.pipeline_model_parallel_size=1",
                  "roles.critic.parallel.virtual_pipeline_model_parallel_size=1",
                  "roles.reference.parallel.virtual_pipeline_model_parallel_size=1")
    specs = ppo_role_specs(cfg, 2, TOKENIZER)
    assert (specs["actor"].layout.pp, specs["actor"].layout.vpp) == (2, 2)
    assert (specs["critic"].layout.pp, specs["critic"].layout.vpp) == (2, None)
    assert (specs["reward"].layout.pp, specs["reward"].layout.vpp) == (1, None)
    assert (specs["reference"].layout.pp, specs["reference"].layout.vpp) == (2, None)


def test_today_configs_resolve_unchanged(ckpts):
    cfg = load_config("configs/demo/ppo.yaml", [f"ppo.sft_checkpoint={ckpts['sft']}",
                                                f"ppo.reward_checkpoint={ckpts['rm']}",
                                                "model.num_layers=4"])
    specs = ppo_role_specs(cfg, 1, TOKENIZER)
    assert specs["actor"].model.num_layers == 4 and specs["reward"].model.hidden_size == 32
    assert specs["actor"].model.hidden_dropout == 0.0


@pytest.mark.parametrize("extra, message", [
    # a shape written in the config that the checkpoint contradicts
    (["roles.reward.model.num_layers=3"],
     "roles.reward: roles.reward.model.num_layers=3 but the checkpoint"),
    (["model.hidden_size=128"], "roles.actor: model.hidden_size=128 but the checkpoint"),
    # a role's TP x PP not dividing the world size
    (["roles.critic.parallel.tensor_model_parallel_size=2",
      "roles.critic.parallel.pipeline_model_parallel_size=2"],
     "world size=2 is invalid: must be a multiple of tensor x pipeline parallel size = 2 x 2 "
     "= 4 (roles.critic.parallel)"),
    # heads / layers not divisible by the role's TP / PP
    (["roles.reward.parallel.tensor_model_parallel_size=3"],
     "roles.reward.parallel.tensor_model_parallel_size=3 is invalid: must divide "
     "roles.reward.model.num_attention_heads=4"),
    (["roles.reward.parallel.pipeline_model_parallel_size=2",
      "roles.reward.parallel.virtual_pipeline_model_parallel_size=2"],
     "roles.reward.model.num_layers=2 is invalid: must be divisible by the number of pipeline "
     "chunks 4"),
    (["roles.actor.checkpoint=/elsewhere"],
     "roles.actor.checkpoint='/elsewhere' and ppo.sft_checkpoint="),
    (["ppo.advantage_estimator=grpo", "ppo.group_size=2",
      "roles.critic.parallel.tensor_model_parallel_size=1"],
     "roles.critic is configured but this run has no critic"),
    (["roles.reference.optimizer.lr=1e-3"], "roles.reference.optimizer is set, but the "
                                            "reference role is frozen"),
    (["rollout.tensor_parallel_size=3"], "rollout.tensor_parallel_size=3 is invalid"),
])
def test_layout_and_override_errors_name_the_role_and_field(ckpts, extra, message):
    with pytest.raises(ValueError) as err:
        ppo_role_specs(ppo_cfg(ckpts, *extra), 2, TOKENIZER)
    assert message in str(err.value)


def test_wrong_kind_of_checkpoint_for_the_role(tmp_path, ckpts):
    swapped = load_config(None, [f"ppo.sft_checkpoint={ckpts['rm']}",
                                 f"ppo.reward_checkpoint={ckpts['rm']}"])
    with pytest.raises(ConfigError, match=r"roles\.actor: the checkpoint .*rm.* is a value "
                                          r"model \(scalar head\), but this role needs a "
                                          r"language model"):
        ppo_role_specs(swapped, 1, TOKENIZER)
    lm_as_reward = load_config(None, [f"ppo.sft_checkpoint={ckpts['sft']}",
                                      f"ppo.reward_checkpoint={ckpts['sft']}"])
    with pytest.raises(ConfigError, match=r"roles\.reward: the checkpoint .* is a language "
                                          r"model \(LM head\), but this role needs a value"):
        ppo_role_specs(lm_as_reward, 1, TOKENIZER)
    # A critic may start from the SFT model: its trunk, with a fresh scalar head.
    ok = ppo_role_specs(ppo_cfg(ckpts, "ppo.critic_init=sft"), 1, TOKENIZER)
    assert ok["critic"].trunk_only and ok["critic"].model.num_layers == 4


def test_reward_vocabulary_or_tokenizer_differs_from_the_actors(tmp_path, ckpts):
    other_vocab = checkpoint(tmp_path, "rm50", "reward", "value", vocab_size=50,
                             tokenizer={"vocab_size": 50, "sha256": "zzz"})
    cfg = load_config(None, [f"ppo.sft_checkpoint={ckpts['sft']}",
                             f"ppo.reward_checkpoint={other_vocab}"])
    with pytest.raises(ConfigError, match=r"roles\.reward: vocab_size=50 differs from the "
                                          r"actor's \(43\)"):
        ppo_role_specs(cfg, 1)
    same_size = checkpoint(tmp_path, "rm_other_tok", "reward", "value",
                           tokenizer={"vocab_size": 43, "sha256": "other"})
    cfg = load_config(None, [f"ppo.sft_checkpoint={ckpts['sft']}",
                             f"ppo.reward_checkpoint={same_size}"])
    with pytest.raises(ConfigError, match=r"roles\.reward: the checkpoint .* was trained with "
                                          r"another tokenizer \(43 pieces, sha256 other\)"):
        ppo_role_specs(cfg, 1, TOKENIZER)
    with pytest.raises(ConfigError, match=r"roles\.reward: .* another tokenizer than the "
                                          r"actor's"):
        ppo_role_specs(cfg, 1)
    bigger = {"vocab_size": 60, "sha256": "x"}
    with pytest.raises(ConfigError, match=r"roles\.actor: the model's vocab_size=43 is smaller "
                                          r"than the tokenizer's vocabulary \(60\)"):
        ppo_role_specs(ppo_cfg(ckpts), 1, bigger)


def test_single_role_takes_the_checkpoint_model(tmp_path, ckpts):
    cfg = load_config(None, [f"checkpoint.load={ckpts['rm']}"])
    spec = single_role_spec(cfg, name="model", kind="value", world_size=1, trained=False)
    assert spec.model.hidden_size == 32 and spec.checkpoint_role == "reward"
    with pytest.raises(ConfigError, match=r"is a value model \(scalar head\), but this role "
                                          r"needs a language model"):
        single_role_spec(cfg, name="model", kind="lm", world_size=1, trained=False)
    bad = load_config(None, [f"checkpoint.load={ckpts['rm']}", "model.num_layers=5"])
    with pytest.raises(ConfigError, match=r"model.num_layers=5 but the checkpoint"):
        single_role_spec(bad, name="model", kind="value", world_size=1, trained=False)
    missing = load_config(None, [f"checkpoint.load={os.path.join(str(tmp_path), 'nope')}"])
    with pytest.raises(ConfigError, match=r"checkpoint.load='.*nope': checkpoint .* does not "
                                          r"exist"):
        single_role_spec(missing, name="model", kind="lm", world_size=1, trained=False)


def test_megatron_still_reads_global_state_where_roles_work_around_it():
    """Roles never initialise megatron's global parallel_state. megatron-core 0.16.1 still
    reads it in two places the role builder covers (models/gpt.py): the tied output
    layer's checkpoint entry on the last pipeline stage, and the dp group of a sharded
    state dict built without metadata. When this fails, the workaround can go."""
    import inspect

    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer import utils

    tie = inspect.getsource(LanguageModule.tie_embeddings_and_output_weights_state_dict)
    assert "parallel_state.get_data_parallel_rank" in tie
    assert "parallel_state.get_data_parallel_group" in inspect.getsource(
        utils.ensure_metadata_has_dp_cp_group)
