"""Config loading, overrides and every validation error (no process group needed)."""

import dataclasses
import textwrap

import pytest

from megarlhf.config import (
    ALIASES, Config, ConfigError, check_ppo, dump_config, load_config, padded_vocab_size,
    read_config, validate_layout)


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_yaml_and_overrides(tmp_path):
    path = write(tmp_path, """
        model:
          arch: gpt2
          num_layers: 4
        ppo:
          clip_eps: 0.1
    """)
    cfg = load_config(path, ["model.num_layers=6", "rollout.stop_token_ids=[2, 3]",
                             "model.num_query_groups=null"])
    assert cfg.model.arch == "gpt2" and cfg.model.num_layers == 6
    assert cfg.ppo.clip_eps == 0.1 and cfg.rollout.stop_token_ids == [2, 3]
    assert cfg.model.tied and cfg.model.qkv_bias  # gpt2 defaults
    assert isinstance(cfg.optimizer.lr, float)


def test_values_are_read_as_their_fields_type(tmp_path):
    """A text field takes an override's text as written - YAML 1.1 would make run.name=on
    True, "1e3" a string and "null" None - and config files read booleans as YAML 1.2 does
    (true / false only), so a text field is never turned into a boolean, and a yes / on
    for a boolean field is an error rather than a guess."""
    cfg = load_config(None, ["run.name=on", "tokenizer.path=1e3", "data.eval_path=null",
                             "rollout.rewards.fn='my.mod:fn'", "run.output_dir=\"a b\""])
    assert cfg.run.name == "on" and cfg.tokenizer.path == "1e3"
    assert cfg.data.eval_path is None and cfg.rollout.rewards.fn == "my.mod:fn"
    assert cfg.run.output_dir == "a b"
    assert load_config(None, ["ppo.sft_checkpoint=off"]).roles.actor.checkpoint == "off"
    assert load_config(write(tmp_path, "run:\n  name: yes\n")).run.name == "yes"
    cfg = load_config(write(tmp_path, "rollout:\n  stop_at_eos: False\n"),
                      ["rollout.greedy=true"])
    assert cfg.rollout.stop_at_eos is False and cfg.rollout.greedy is True
    for bad in (["rollout.stop_at_eos=yes"], ["rollout.greedy=on"]):
        with pytest.raises(ConfigError, match="expected true or false"):
            load_config(None, bad)
    with pytest.raises(ConfigError, match="expected true or false"):
        load_config(write(tmp_path, "rollout:\n  stop_at_eos: off\n"))
    with pytest.raises(ConfigError, match="override value '\\[1, 2' is not valid YAML"):
        load_config(None, ["rollout.stop_token_ids=[1, 2"])


def test_exponent_floats_without_a_dot(tmp_path):
    # PyYAML (YAML 1.1) reads `1e-5` as a string; the loader must still take it as a number.
    path = write(tmp_path, """
        optimizer:
          lr: 1e-5
    """)
    cfg = load_config(path, ["optimizer.critic_lr=3E-6", "ppo.kl.init_coef=.5"])
    assert cfg.optimizer.lr == 1e-5 and cfg.optimizer.critic_lr == 3e-6
    assert cfg.ppo.kl.init_coef == 0.5
    with pytest.raises(ConfigError, match="expected a number"):
        load_config(None, ["optimizer.lr=1e-5x"])


@pytest.mark.parametrize("override, message", [
    ("model.num_layer=3", "unknown config key 'model.num_layer'; did you mean 'model.num_layers'"),
    ("modle.arch=llama", "did you mean 'model'"),
    ("ppo.cliprange=0.1", "did you mean 'ppo.cliprange_value'"),
    ("model.arch=gpt3", "model.arch='gpt3' is invalid: choose one of 'llama', 'gpt2'"),
    ("model.hidden_size=abc", "model.hidden_size='abc' has the wrong type: expected an integer"),
    ("model.hidden_size=1.5", "expected an integer"),
    ("run.deterministic=3", "expected true or false"),
    ("ppo.clip_eps=2", "ppo.clip_eps=2.0 is invalid: must be in (0, 1)"),
    ("model.hidden_size=65", "model.hidden_size=65 is invalid: must be divisible by "
                             "model.num_attention_heads=4"),
    ("model.num_query_groups=3", "model.num_query_groups=3 is invalid: must divide "
                                 "model.num_attention_heads=4"),
    ("parallel.virtual_pipeline_model_parallel_size=2", "needs parallel.pipeline_model_parallel_size >= 2"),
    ("rollout.temperature=0", "rollout.greedy=true"),
    ("model.fp8=3", "model.fp8 must be a mapping"),
    ("model=3", "model must be a mapping"),
    ("model.arch.x=1", "'model.arch' is a value, not a section"),
    ("noequals", "must look like key.sub=value"),
    ("run.metric_bands={objective/kl: [1]}", "must be [low, high]"),
    ("run.metric_bands={objective/kl: [null, null]}", "bounds nothing"),
    ("run.metric_bands={objective/kl: [2, 1]}", "low must be below high"),
    ("run.metric_bands={objective/kl: [0, .inf]}", "bounds must be finite numbers or null"),
    ("run.metric_bands={objective/kl: [a, 1]}", "expected a number"),
    ("run.allow_nonfinite=['']", "must list metric names or patterns"),
])
def test_config_errors(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "model: [1, 2\n"))
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(write(tmp_path, "- 1\n- 2\n"))
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"run:\n  name: caf\xe9\n")
    with pytest.raises(ConfigError, match="latin1.yaml is not UTF-8 text"):
        load_config(str(latin1))
    with pytest.raises(ConfigError, match="did you mean 'model.hidden_size'"):
        load_config(write(tmp_path, "model:\n  hiden_size: 3\n"))
    # plain YAML keeps the last of a repeated key, silently
    path = write(tmp_path, "model:\n  num_layers: 2\n  hidden_size: 64\n  num_layers: 3\n")
    with pytest.raises(ConfigError, match=f"{path}: key 'num_layers' is given twice, on "
                                          "lines 2 and 4"):
        load_config(path)


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.tensor_model_parallel_size=3"], 3,
     "parallel.tensor_model_parallel_size=3 is invalid: must divide model.num_attention_heads=4"),
    (["parallel.tensor_model_parallel_size=4", "model.num_query_groups=2"], 4,
     "must divide the number of query groups (model.num_query_groups=2)"),
    (["model.num_layers=3", "parallel.pipeline_model_parallel_size=2"], 2,
     "model.num_layers=3 is invalid: must be divisible by the number of pipeline chunks 2"),
    (["model.num_layers=4", "parallel.pipeline_model_parallel_size=2",
      "parallel.virtual_pipeline_model_parallel_size=4"], 2,
     "must be divisible by the number of pipeline chunks 8"),
    (["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"], 2,
     "world size=2 is invalid: must be a multiple of tensor x pipeline parallel size = 2 x 2"),
    (["parallel.tensor_model_parallel_size=2"], 3, "world size=3 is invalid"),
    (["rollout.tensor_parallel_size=4"], 2, "rollout.tensor_parallel_size=4 is invalid: must "
                                            "divide the world size 2"),
    (["model.ffn_hidden_size=33", "parallel.tensor_model_parallel_size=2"], 2,
     "must divide the MLP width 33"),
])
def test_layout_errors(overrides, world, message):
    cfg = load_config(None, overrides)
    with pytest.raises(ValueError) as err:
        validate_layout(cfg, world)
    assert message in str(err.value)


MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=48"]
MLA = ["model.mla.kv_lora_rank=15", "model.mla.q_lora_rank=32", "model.mla.qk_head_dim=8",
       "model.mla.qk_pos_emb_head_dim=8", "model.mla.v_head_dim=16"]


@pytest.mark.parametrize("overrides, world, message", [
    (MOE + ["parallel.expert_model_parallel_size=3"], 3,
     "parallel.expert_model_parallel_size=3 is invalid: must divide model.moe.num_experts=4"),
    (MOE + ["parallel.expert_model_parallel_size=4"], 2,
     "world size=2 is invalid: must be a multiple of expert tensor x expert x pipeline "
     "parallel size = 1 x 4 x 1"),
    (MOE + ["parallel.expert_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"],
     2, "must be a multiple of expert tensor x expert x pipeline parallel size = 1 x 2 x 2"),
    (MOE + ["parallel.expert_tensor_parallel_size=5"], 5,
     "parallel.expert_tensor_parallel_size=5 is invalid: must divide the expert MLP width 48"),
    (["parallel.expert_model_parallel_size=2"], 2,
     "parallel.expert_model_parallel_size=2 is invalid: must be 1: model is dense"),
    (MLA + ["parallel.tensor_model_parallel_size=2"], 2,
     "parallel.tensor_model_parallel_size=2 is invalid: must divide "
     "model.mla.kv_lora_rank + qk_pos_emb_head_dim = 23"),
    (MLA + ["model.mla.q_lora_rank=null", "rollout.tensor_parallel_size=2"], 2,
     "rollout.tensor_parallel_size=2 is invalid: must be 1 with the actor's "
     "model.mla.q_lora_rank=null"),
])
def test_expert_layout_errors(overrides, world, message):
    """Expert parallelism is checked before any process group exists, naming the field."""
    cfg = load_config(None, overrides)
    with pytest.raises(ValueError) as err:
        validate_layout(cfg, world)
    assert message in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["model.moe.num_experts=4", "model.moe.top_k=5"],
     "model.moe.top_k=5 is invalid: must be between 1 and model.moe.num_experts=4"),
    (["model.moe.num_experts=4", "model.num_layers=2", "model.moe.first_k_dense=2"],
     "model.moe.first_k_dense=2 is invalid: must be below model.num_layers=2"),
    (["model.moe.num_experts=4", "model.arch=gpt2"], "model.arch='gpt2' is invalid: must be "
     "llama for a mixture-of-experts model"),
    (["model.moe.num_experts=-1"], "model.moe.num_experts=-1 is invalid"),
    (MOE + ["model.moe.score_function=sigmoid", "model.moe.normalize_top_k=false"],
     "model.moe.normalize_top_k=False is invalid: must be true with score_function=sigmoid "
     "and top_k=2"),
    (MOE + ["model.moe.num_groups=2"], "model.moe.group_top_k=None is invalid: must be set "
     "exactly when model.moe.num_groups is (it is 2)"),
    (MOE + ["model.moe.num_groups=3", "model.moe.group_top_k=1"],
     "model.moe.num_groups=3 is invalid: must divide model.moe.num_experts=4"),
    (MOE + ["model.moe.top_k=3", "model.moe.num_groups=2", "model.moe.group_top_k=1"],
     "model.moe.top_k=3 is invalid: must be a multiple of model.moe.group_top_k=1 whose "
     "quotient fits in a group of 2 experts"),
    (MLA + ["model.num_query_groups=2"], "model.num_query_groups=2 is invalid: is not used "
     "by multi-latent attention"),
    (MLA + ["model.arch=gpt2"], "must be llama for multi-latent attention"),
    (MLA + ["model.rope_scaling.type=llama3"], "model.rope_scaling.type='llama3' is invalid: "
     "must be none or yarn with multi-latent attention"),
    (["model.mla.kv_lora_rank=16", "model.mla.qk_pos_emb_head_dim=3"],
     "model.mla.qk_pos_emb_head_dim=3 is invalid: must be an even number >= 2"),
])
def test_moe_field_errors(overrides, message):
    with pytest.raises(ValueError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_a_mixture_of_experts_layout_passes():
    cfg = load_config(None, MOE + ["parallel.expert_model_parallel_size=2",
                                   "parallel.tensor_model_parallel_size=2"])
    assert cfg.parallel.layout.expert_tp == 2 and cfg.parallel.layout.expert_dp(4) == 1
    validate_layout(cfg, 4)
    validate_layout(cfg, 8)


def test_valid_layouts_pass():
    cfg = load_config(None, ["model.num_layers=4", "parallel.pipeline_model_parallel_size=2",
                             "parallel.tensor_model_parallel_size=2"])
    validate_layout(cfg, 4)
    validate_layout(cfg, 8)


def test_vocab_padding():
    assert padded_vocab_size(300, 16, 1) == 304
    assert padded_vocab_size(300, 16, 2) == 320
    assert padded_vocab_size(32000, 128, 8) == 32768
    assert padded_vocab_size(256, 128, 2) == 256


def test_fp8_needs_low_precision():
    cfg = load_config(None, ["model.fp8.enabled=true"])
    with pytest.raises(ValueError, match="needs model.params_dtype bfloat16 or float16"):
        validate_layout(cfg, 1)


def test_config_show_cli(tmp_path):
    from conftest import run_cli
    proc = run_cli("config", "show", "model.num_layers=7")
    assert "num_layers: 7" in proc.stdout
    bad = run_cli("config", "show", "model.num_layrs=7", check=False)
    assert bad.returncode == 2 and "did you mean 'model.num_layers'" in bad.stderr


# ------------------------------------------------------------------ PPO settings that do nothing

@pytest.mark.parametrize("overrides, message", [
    (["ppo.advantage_estimator=grpo", "ppo.group_size=4", "ppo.kl.init_coef=0.1"],
     "ppo.kl.init_coef=0.1 has no effect: the KL is not in the reward"),
    (["ppo.advantage_estimator=grpo", "ppo.group_size=4", "ppo.kl.controller=adaptive"],
     "ppo.kl.controller=adaptive tunes the KL coefficient of the reward"),
    (["ppo.kl.in_reward=false", "ppo.kl.controller=adaptive"],
     "but the KL is not in the reward"),
    (["ppo.kl.loss_estimator=k2"], "ppo.kl.loss_estimator has no effect with ppo.kl.loss_coef=0"),
    (["ppo.grpo_normalization=token"], "ppo.grpo_normalization has no effect"),
    (["ppo.correction.behavior_weight_cap=5"], "applies to ppo.policy_loss=decoupled only"),
    (["ppo.correction.is_cap=2", "rollout.recompute_logprobs=false"],
     "ppo.correction.is_cap compares the trainer's log-probs with the sampler's"),
    (["ppo.policy_loss=decoupled", "rollout.recompute_logprobs=false"],
     "ppo.policy_loss=decoupled compares"),
    (["ppo.policy_loss=decoupled", "ppo.correction.is_cap=2"], "has its own importance weight"),
    # at ppo.max_staleness > 0 the decoupled loss is the default, and the messages say so
    (["ppo.max_staleness=1", "ppo.correction.is_cap=2"],
     "ppo.policy_loss=null (decoupled: the default with ppo.max_staleness=1): the decoupled"),
    (["ppo.max_staleness=2", "rollout.recompute_logprobs=false"],
     "ppo.policy_loss=null (decoupled: the default with ppo.max_staleness=2) compares"),
    (["ppo.max_staleness=-1"], "ppo.max_staleness=-1 is invalid"),
    (["ppo.policy_loss=ppo", "ppo.max_staleness=1", "ppo.correction.behavior_weight_cap=5"],
     "applies to ppo.policy_loss=decoupled only (ppo.policy_loss=ppo)"),
    (["ppo.ptx_coef=0.5"], "PPO-ptx needs both ppo.ptx_coef > 0 and data.ptx_path"),
    (["data.ptx_path=x.jsonl"], "PPO-ptx needs both"),
    (["ppo.ptx_batch_size=8"], "ppo.ptx_batch_size has no effect"),
    (["ppo.overlong_buffer=32"], "ppo.overlong_buffer=32 must be below rollout.max_new_tokens"),
    (["ppo.overlong_penalty=2"], "ppo.overlong_penalty has no effect"),
    (["ppo.max_sampling_rounds=3"], "ppo.max_sampling_rounds has no effect"),
    (["ppo.dynamic_sampling=true"], "must be >= 2 with ppo.dynamic_sampling"),
    (["ppo.correction.mask_high=0.5"], "ppo.correction.mask_high=0.5 is invalid"),
    (["ppo.value_loss_coef=0"], "ppo.value_loss_coef=0.0 is invalid"),
    # partial rollouts: rollout ranks to send weights to, and updates while they sample
    (["rollout.placement.partial=true"], "rollout.placement.partial apply to rollout.placement.mode=split only"),
    (["rollout.placement.mode=split", "rollout.placement.ranks=1", "rollout.placement.partial=true"],
     "rollout.placement.partial needs ppo.max_staleness >= 1"),
    (["rollout.placement.mode=split", "rollout.placement.ranks=1", "ppo.max_staleness=1",
      "rollout.placement.partial_kv=keep"], "rollout.placement.partial_kv has no effect without rollout.placement.partial"),
    # split placement's own deadlines: nothing crosses when colocated; positive
    (["rollout.placement.sync_timeout_minutes=5"],
     "rollout.placement.sync_timeout_minutes has no effect without rollout.placement.mode=split"),
    (["rollout.placement.request_timeout_minutes=5"],
     "rollout.placement.request_timeout_minutes has no effect without rollout.placement.mode=split"),
    (["rollout.placement.mode=split", "rollout.placement.ranks=1",
      "rollout.placement.sync_timeout_minutes=0"], "rollout.placement.sync_timeout_minutes=0"),
    # the decode slots' KV cache: nothing without slots, a pool that holds one sequence
    (["rollout.kv_cache=columns"], "rollout.kv_cache has no effect without rollout.decode_slots"),
    (["rollout.decode_slots=4", "rollout.kv_cache=columns", "rollout.kv_block_tokens=8"],
     "rollout.kv_block_tokens has no effect without rollout.decode_slots and rollout.kv_cache=paged"),
    (["rollout.kv_cache_tokens=4096"], "rollout.kv_cache_tokens=4096 is invalid: sizes the paged cache"),
    (["rollout.decode_slots=4", "rollout.kv_cache_tokens=100"],
     "rollout.kv_cache_tokens=100 cannot hold one sequence: data.max_prompt_len (128) + "
     "rollout.max_new_tokens (32) - 1 = 159 positions"),
    (["rollout.decode_slots=4", "rollout.kv_cache_tokens=1000", "model.mla.kv_lora_rank=16"],
     "the paged KV cache, which cannot decode multi-latent attention"),
    (["rollout.kv_cache=pages"], "rollout.kv_cache='pages' is invalid: must be 'paged' or 'columns'"),
    # on-policy distillation's settings without a teacher, or without their mode
    (["ppo.teacher.kl_in=loss"], "ppo.teacher.kl_in has no effect with ppo.teacher.coef=0"),
    (["ppo.teacher.coef=0.1", "ppo.teacher.loss_estimator=k3"],
     "ppo.teacher.loss_estimator has no effect with ppo.teacher.kl_in=reward"),
    (["ppo.teacher.coef=0.1", "ppo.teacher.task_reward=false", "ppo.reward_checkpoint=/rm"],
     "ppo.teacher.task_reward=false scores nothing with the task's reward, but a reward "
     "source is set"),
    (["ppo.teacher.coef=-1"], "ppo.teacher.coef=-1.0 is invalid"),
    (["rollout.kv_block_tokens=0"], "rollout.kv_block_tokens=0 is invalid"),
    # an agent's episodes: one source of them, its settings only with it
    (["rollout.agent.entry=a.b:f", "rollout.environment.name=a.b:Env"],
     "and rollout.agent.entry=a.b:f are two sources of episodes"),
    (["rollout.agent.entry=a.b:f", "rollout.agent.command=python x.py"],
     "rollout.agent.command are two agents"),
    (["rollout.agent.entry=abc"], "must look like 'package.module:function'"),
    (["rollout.agent.max_requests=3"], "rollout.agent.max_requests has no effect without "
                                       "rollout.agent.entry or rollout.agent.command"),
    (["rollout.agent.tool_format=hermes"], "rollout.agent.tool_format has no effect"),
    (["rollout.agent.entry=a.b:f", "rollout.rewards.workers=4"],
     "rollout.rewards.workers has no effect with rollout.agent.entry=a.b:f and no "
     "rollout.rewards.fn or url"),
    (["rollout.agent.entry=a.b:f", "rollout.decode_slots=4"],
     "rollout.agent.entry='a.b:f' is invalid: samples each turn as one static batch"),
    (["rollout.agent.entry=a.b:f", "rollout.stop_at_eos=false"],
     "must be true with rollout.agent"),
    (["rollout.agent.entry=a.b:f", "rollout.routing_replay=r3"],
     "rollout.routing_replay does not take rollout.agent.entry yet"),
    (["rollout.agent.entry=a.b:f", "ppo.reward_checkpoint=/rm"],
     "both a reward-model checkpoint and rollout.agent.entry are set"),
    (["rollout.agent.batch_wait_s=-1"], "rollout.agent.batch_wait_s=-1.0 is invalid"),
    # a judge: one reward source, its role and settings only with it
    (["rollout.judge.template=rate {response}", "ppo.reward_checkpoint=/rm"],
     "both a reward-model checkpoint and rollout.judge.template are set"),
    (["rollout.judge.template=rate {response}", "rollout.rewards.fn=a.b:f"],
     "rollout.judge.template and rollout.rewards.fn are two reward sources"),
    (["rollout.judge.template=rate it"], "must contain {response}"),
    (["rollout.judge.template=rate {response}", "rollout.judge.pattern=[0-9]+"],
     "needs a group, (...), around the score"),
    (["rollout.judge.template=rate {response}", "rollout.judge.pattern=(["],
     "is not a regular expression"),
    (["rollout.judge.labels={yes: 1}"], "rollout.judge.labels has no effect without "
                                        "rollout.judge.template"),
    (["roles.judge.checkpoint=/j"], "roles.judge is configured but ppo has no judge role"),
    (["rollout.judge.template=rate {response}", "roles.judge.checkpoint=/j",
      "roles.judge.parallel.pipeline_model_parallel_size=2"],
     "roles.judge.parallel.pipeline_model_parallel_size has no effect: the judge generates"),
    (["rollout.judge.template=rate {response}", "roles.judge.checkpoint=/j",
      "ppo.critic_init=sft", "roles.judge.offload=optimizer"],
     "roles.judge.offload='optimizer': the judge role is frozen"),
    (["rollout.judge.template=rate {response}", "rollout.judge.max_new_tokens=0"],
     "rollout.judge.max_new_tokens=0 is invalid"),
])
def test_ppo_settings_without_effect_are_errors(overrides, message):
    from megarlhf.config import check_ppo
    with pytest.raises((ConfigError, ValueError)) as err:
        check_ppo(*read_config(None, overrides), planning=True)
    assert message in str(err.value)


def test_ppo_settings_that_do_something_pass():
    from megarlhf.config import check_ppo
    for overrides in (
            [],
            # GRPO batches count samples: 8 prompts x 4 = 32 samples in one mini-batch.
            ["ppo.advantage_estimator=grpo", "ppo.group_size=4", "ppo.rollout_batch_size=8",
             "ppo.mini_batch_size=32", "ppo.kl.loss_coef=0.04"],
            ["ppo.advantage_estimator=grpo", "ppo.group_size=4", "ppo.kl.in_reward=true",
             "ppo.kl.init_coef=0.1", "ppo.grpo_normalization=token"],
            ["ppo.policy_loss=decoupled", "ppo.correction.behavior_weight_cap=5"],
            ["ppo.max_staleness=2", "ppo.correction.behavior_weight_cap=5"],
            ["ppo.max_staleness=1", "ppo.policy_loss=ppo", "ppo.correction.is_cap=2"],
            ["rollout.placement.mode=split", "rollout.placement.ranks=1", "ppo.max_staleness=1",
             "rollout.placement.partial=true", "rollout.placement.partial_kv=keep"],
            ["rollout.decode_slots=4", "rollout.kv_block_tokens=8", "rollout.kv_cache_tokens=159"],
            ["rollout.decode_slots=4", "rollout.kv_cache=columns"],
            ["ppo.correction.is_cap=2", "ppo.correction.mask_low=0.5", "ppo.correction.mask_high=2"],
            ["ppo.ptx_coef=0.5", "data.ptx_path=x.jsonl", "ppo.ptx_batch_size=8"],
            ["ppo.advantage_estimator=rloo", "ppo.group_size=2", "ppo.dynamic_sampling=true",
             "ppo.max_sampling_rounds=3", "ppo.overlong_buffer=8", "ppo.overlong_penalty=0.5"],
            # an agent, its verifier for the episodes it leaves unscored
            ["ppo.advantage_estimator=grpo", "ppo.group_size=2",
             "rollout.agent.command=python agent.py", "rollout.agent.max_requests=2",
             "rollout.agent.tool_format=hermes", "rollout.rewards.fn=a.b:score",
             "rollout.rewards.workers=1"],
            ["ppo.advantage_estimator=grpo", "ppo.group_size=2",
             "rollout.judge.template=Rate {response} from 0 to 9", "roles.judge.checkpoint=/j",
             "rollout.judge.labels={good: 1, bad: 0}", "rollout.judge.chat=false",
             "roles.judge.parallel.tensor_model_parallel_size=2", "roles.judge.offload=all"]):
        check_ppo(*read_config(None, overrides), planning=True)
    assert not load_config(None, ["ppo.advantage_estimator=grpo",
                                  "ppo.group_size=2"]).ppo.kl_reward_on
    assert load_config(None, ["ppo.advantage_estimator=rloo", "ppo.group_size=2"]).ppo.kl_reward_on
    # the policy loss: decoupled by default once batches may be stale
    assert not load_config(None, []).ppo.decoupled_loss
    assert load_config(None, ["ppo.max_staleness=1"]).ppo.decoupled_loss
    assert not load_config(None, ["ppo.max_staleness=1", "ppo.policy_loss=ppo"]).ppo.decoupled_loss


# ------------------------------------------------------------------ provenance and aliases

def test_loader_returns_what_was_written_and_the_config_is_frozen(tmp_path):
    import dataclasses
    path = write(tmp_path, "model:\n  num_layers: 6\n  fp8:\n    enabled: false\n")
    cfg, written = read_config(path, ["roles.reward.model.params_dtype=float32",
                                      "optimizer.lr=3e-5"])
    assert written.fields("model") == {"num_layers", "fp8"}
    assert written.fields("model.fp8") == {"enabled"}
    assert written.fields("roles.reward.model") == {"params_dtype"}
    assert written.fields("roles.actor") == frozenset() and "roles.actor" not in written
    # float32 is the default; written all the same (a role's model takes it over its
    # checkpoint's bfloat16)
    assert cfg.roles.reward.model.params_dtype == "float32" and "optimizer.lr" in written
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.num_layers = 4
    # a config built in code: what differs from the defaults counts as written
    from megarlhf.config import Written
    coded = Written.differing(cfg)
    assert coded.fields("model") == {"num_layers"} and "roles.reward.model.params_dtype" \
        not in coded and "optimizer.lr" in coded


def test_aliases_are_resolved_once_into_the_role_field(tmp_path):
    cfg, written = read_config(None, ["ppo.sft_checkpoint=a", "dpo.reference_checkpoint=r"])
    assert cfg.roles.actor.checkpoint == "a" and cfg.roles.reference.checkpoint == "r"
    assert written.spelling("roles.actor.checkpoint") == "ppo.sft_checkpoint"
    assert not hasattr(cfg.ppo, "sft_checkpoint")
    # the same value both ways is one setting; different values are refused
    same = read_config(None, ["ppo.reward_checkpoint=b", "roles.reward.checkpoint=b"])
    assert same.config.roles.reward.checkpoint == "b"
    with pytest.raises(ConfigError, match="roles.actor.checkpoint='x' and ppo.sft_checkpoint="
                                          "'y' disagree"):
        read_config(write(tmp_path, "roles:\n  actor:\n    checkpoint: x\n"
                                    "ppo:\n  sft_checkpoint: y\n"))
    with pytest.raises(ConfigError, match="disagree"):
        read_config(None, ["roles.teacher.checkpoint=x", "distill.teacher_checkpoint=y"])
    # null unsets: an override clears what the file wrote, and nothing counts as written
    path = write(tmp_path, "ppo:\n  reward_checkpoint: rm\n")
    cfg, written = read_config(path, ["ppo.reward_checkpoint=null"])
    assert cfg.roles.reward.checkpoint is None and not written.fields("roles.reward")
    # a config dumped before the aliases (it holds them as null fields) still loads
    old = write(tmp_path, "ppo:\n  sft_checkpoint: null\n  reward_checkpoint: null\n"
                          "dpo:\n  reference_checkpoint: null\n")
    assert load_config(old).roles.actor.checkpoint is None
    with pytest.raises(ConfigError, match="expected a string"):
        read_config(write(tmp_path, "ppo:\n  sft_checkpoint: 3\n"))
    # an override of a text field is its text (a folder may be called 3)
    assert load_config(None, ["ppo.sft_checkpoint=3"]).roles.actor.checkpoint == "3"
    with pytest.raises(ConfigError, match="did you mean 'ppo.sft_checkpoint'"):
        read_config(None, ["ppo.sft_chekpoint=a"])


def test_the_split_sections_load_from_their_old_names(tmp_path):
    """ppo.kl, ppo.correction, rollout.placement, rollout.rewards and rollout.environment
    were fields of ppo and rollout: a config written with the old names (every one of them)
    loads into the same config as one written with the new, the written keys are the new
    names, and a section's shorthand (``placement: split``) is its main field."""
    old = write(tmp_path, """\
ppo:
  kl_estimator: k3
  kl_in_reward: true
  kl_loss_coef: 0.01
  kl_loss_estimator: k2
  kl_controller: adaptive
  init_kl_coef: 0.2
  kl_target: 4.0
  kl_horizon: 50
  policy_loss: decoupled
  behavior_weight_cap: 5.0
  rollout_mask_low: 0.5
  rollout_mask_high: 2.0
  max_staleness: 1
rollout:
  placement: split
  ranks: 2
  weight_checksum: true
  partial: false
  partial_kv: keep
  environment: pkg.mod:Env
  max_turns: 3
  max_observation_tokens: 100
  tool_format: hermes
  reward_workers: 0
  reward_timeout_s: 5.0
  reward_batch: 4
  reward_on_error: penalty
  reward_error_score: -2.0
""", "old.yaml")
    new = write(tmp_path, """\
ppo:
  kl: {estimator: k3, in_reward: true, loss_coef: 0.01, loss_estimator: k2,
       controller: adaptive, init_coef: 0.2, target: 4.0, horizon: 50}
  correction: {behavior_weight_cap: 5.0, mask_low: 0.5, mask_high: 2.0}
  policy_loss: decoupled
  max_staleness: 1
rollout:
  placement: {mode: split, ranks: 2, weight_checksum: true, partial: false, partial_kv: keep}
  environment: {name: pkg.mod:Env, max_turns: 3, max_observation_tokens: 100,
                tool_format: hermes}
  rewards: {workers: 0, timeout_s: 5.0, batch: 4, on_error: penalty, error_score: -2.0}
""", "new.yaml")
    (a, wa), (b, wb) = read_config(old), read_config(new)
    assert a == b and a.rollout.placement.mode == "split" and a.ppo.kl.horizon == 50
    assert a.rollout.environment.name == "pkg.mod:Env" and a.rollout.rewards.workers == 0
    assert wa.keys == wb.keys and "rollout.rewards.workers" in wa and "ppo.kl.target" in wa
    assert wa.spelling("ppo.kl.init_coef") == "ppo.init_kl_coef"
    # every moved name is an alias of a field that exists; the remaining two by overrides
    for alias, canonical in ALIASES.items():
        assert alias not in _leaves(Config) and canonical in _leaves(Config), alias
    cfg = load_config(None, ["rollout.reward_url=http://h", "ppo.rollout_is_cap=2",
                             "rollout.placement=split", "rollout.ranks=1",
                             "rollout.reward_retries=1"])
    assert cfg.rollout.rewards.url == "http://h" and cfg.ppo.correction.is_cap == 2.0
    assert cfg.rollout.placement.mode == "split" and cfg.rollout.placement.ranks == 1
    # the shorthand in a file, a field of its section from an override
    cfg = load_config(write(tmp_path, "rollout:\n  placement: split\n", "short.yaml"),
                      ["rollout.placement.ranks=3"])
    assert (cfg.rollout.placement.mode, cfg.rollout.placement.ranks) == ("split", 3)
    with pytest.raises(ConfigError, match="disagree"):
        read_config(None, ["ppo.kl.target=1", "ppo.kl_target=2"])
    with pytest.raises(ConfigError, match="rollout.environment.max_turns has no effect"):
        check_ppo(*read_config(None, ["rollout.max_turns=2"]), planning=True)
    # the dump of a config is the new layout, and loads back as the same config
    assert load_config(write(tmp_path, dump_config(b), "dump.yaml")) == b


def _leaves(cls, prefix=""):
    out = set()
    for f in dataclasses.fields(cls):
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(value):
            out |= _leaves(type(value), f"{prefix}{f.name}.")
        else:
            out.add(prefix + f.name)
    return out


def test_overlay_checks_the_merged_section():
    from megarlhf.config import overlay
    cfg, written = read_config(None, ["optimizer.lr=1e-6", "roles.actor.optimizer.min_lr=1e-5"])
    with pytest.raises(ConfigError, match="optimizer.min_lr=1e-05 is invalid"):
        overlay(cfg.optimizer, cfg.roles.actor.optimizer, written, "roles.actor.optimizer")


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere(monkeypatch):
    """On a terminal, tqdm's bar; in a file (a Slurm log), one line per LINE_INTERVAL_S
    seconds and the last count at the end - no carriage returns."""
    import io

    from tqdm import tqdm

    from megarlhf.stages import common

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert isinstance(common.progress(3, 0, "sft", True, stream=Terminal()), tqdm)
    clock = iter([0.0, 4.0, 11.0, 12.0, 13.0, 25.0])
    monkeypatch.setattr(common.time, "monotonic", lambda: next(clock))
    log = io.StringIO()
    bar = common.progress(6, 1, "ppo", True, stream=log)
    for step in range(5):  # at 4, 11 (shown), 12, 13, 25 (shown) seconds
        bar.update(1)
        bar.set_postfix(kl=f"{step / 10:.2f}")
    bar.close()
    lines = log.getvalue().splitlines()
    assert [line.split(" [")[0] for line in lines] == ["ppo:  50% 3/6", "ppo: 100% 6/6"]
    assert lines[1].endswith(", kl=0.30]") and "\r" not in log.getvalue()
    assert isinstance(common.progress(3, 0, "sft", False, stream=log), tqdm)  # off: silent



def test_a_mixture_of_experts_trains_at_tp2_with_sequence_parallelism():
    """Megatron-core trains MoE layers at TP > 1 only with sequence parallelism (it raises
    in the first training forward, after the rollout): a trained MoE role at TP=2 without
    it is refused before any work, naming the setting; with it, or frozen, it is allowed.
    Sequence parallelism without TP is refused the same way, from the config's own
    sections (a role inherits the actor's only where its TP > 1)."""
    from megarlhf.config import Layout, check_model_layout
    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=64",
                             "model.num_attention_heads=4", "model.moe.num_experts=4",
                             "model.moe.top_k=2"])
    with pytest.raises((ConfigError, ValueError),
                       match="roles.actor.parallel.sequence_parallel=False is invalid: "
                             "must be true to train the mixture"):
        check_model_layout("roles.actor.parallel", cfg.model, Layout(tp=2), 2, trained=True)
    check_model_layout("roles.actor.parallel", cfg.model, Layout(tp=2, sp=True), 2,
                       trained=True)
    check_model_layout("roles.reference.parallel", cfg.model, Layout(tp=2), 2)
    check_model_layout("roles.actor.parallel", cfg.model, Layout(tp=1, ep=2), 2, trained=True)
    with pytest.raises(ConfigError, match="parallel.sequence_parallel=True is invalid: needs "
                                          "tensor_model_parallel_size > 1"):
        load_config(None, ["parallel.sequence_parallel=true"])
    from megarlhf.config import read_config
    from megarlhf.roles.spec import ppo_role_specs
    base = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
            "model.vocab_size=300", "rollout.rewards.fn=a:b", "ppo.critic_init=sft",
            "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
    cfg, written = read_config(None, [*base, "roles.critic.parallel.tensor_model_parallel_size=1"])
    specs = ppo_role_specs(cfg, 2, written=written, planning=True)
    assert {name: spec.layout.sp for name, spec in specs.items()} == \
        {"actor": True, "reference": True, "critic": False}
    cfg, written = read_config(None, [*base, "roles.critic.parallel.tensor_model_parallel_size=1",
                                      "roles.critic.parallel.sequence_parallel=true"])
    with pytest.raises((ConfigError, ValueError),
                       match="roles.critic.parallel.sequence_parallel=True is invalid: needs "
                             "tensor_model_parallel_size > 1"):
        ppo_role_specs(cfg, 2, written=written, planning=True)


def test_context_parallelism_is_checked_before_any_work():
    """``parallel.context_parallel_size``: the world must hold TP x PP x CP (named with
    the sizes), what it does not take yet is refused naming the setting (MLA,
    TransformerEngine's layers, the interleaved schedule; a mixture of experts is taken,
    its experts split over the CP ranks too), a role inherits the actor's
    CP unless it writes its own, the layout says CP and counts DP over it, and a rank's
    coordinates put CP between TP and DP (megatron's tp-cp-ep-dp-pp)."""
    from megarlhf.config import Layout, check_model_layout, read_config
    from megarlhf.roles.spec import ppo_role_specs
    cfg = load_config(None, ["model.num_layers=4", "model.hidden_size=64",
                             "model.num_attention_heads=4"])
    check_model_layout("parallel", cfg.model, Layout(cp=2), 4)
    with pytest.raises((ConfigError, ValueError),
                       match=r"world size=6 is invalid: must be a multiple of "
                             r"tensor x pipeline x context parallel size = 1 x 1 "
                             r"x 4 = 4"):
        check_model_layout("parallel", cfg.model, Layout(cp=4), 6)
    moe = load_config(None, ["model.num_layers=2", "model.hidden_size=64",
                             "model.num_attention_heads=4", "model.moe.num_experts=4",
                             "model.moe.top_k=2"]).model
    check_model_layout("parallel", moe, Layout(cp=2, ep=2), 2)  # experts over the CP ranks
    for extra, what in ((["model.transformer_impl=transformer_engine"], "TransformerEngine"),
                        (MLA, "multi-latent attention"),
                        (["model.sliding_window=8"], "sliding-window attention")):
        model = load_config(None, ["model.num_layers=2", "model.hidden_size=64",
                                   "model.num_attention_heads=4", *extra]).model
        with pytest.raises((ConfigError, ValueError),
                           match=f"roles.actor.parallel.context_parallel_size=2 is invalid: "
                                 f"does not take {what}"):
            check_model_layout("roles.actor.parallel", model, Layout(cp=2), 2)
    with pytest.raises((ConfigError, ValueError),
                       match="context_parallel_size=2 is invalid: does not take the "
                             "interleaved pipeline"):
        check_model_layout("parallel", cfg.model, Layout(pp=2, vpp=2, cp=2), 4)
    with pytest.raises(ConfigError, match="parallel.context_parallel_size=0"):
        load_config(None, ["parallel.context_parallel_size=0"])
    layout = Layout(tp=2, cp=2)
    assert layout.dp(8) == 2 and layout.describe(8) == "TP=2 PP=1 DP=2 CP=2"
    # rank = tp + TP * (cp + CP * dp): ranks 0-3 are DP replica 0, CP ranks 0 0 1 1
    assert [layout.coordinates(r, 8)[1] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    base = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
            "model.vocab_size=300", "rollout.rewards.fn=a:b", "ppo.critic_init=sft",
            "parallel.context_parallel_size=2"]
    cfg, written = read_config(None, [*base, "roles.reference.parallel.context_parallel_size=1"])
    specs = ppo_role_specs(cfg, 2, written=written, planning=True)
    assert {name: spec.layout.cp for name, spec in specs.items()} == \
        {"actor": 2, "reference": 1, "critic": 2}
