"""Context parallelism's pieces (``megarlhf.parallel.context``): the load-balanced split
of a sequence and causal attention over the CP group, against one process."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import WORKERS, run_cli, tiny_ppo_args, torchrun
from megarlhf.parallel import context


def test_the_split_pairs_an_early_chunk_with_a_late_one_and_covers_the_sequence():
    """Megatron's load-balanced split: CP rank r keeps chunks r and 2 CP - 1 - r of 2 CP;
    the ranks' parts cover every position once; a length that does not split is named."""
    assert context.chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context.chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    parts = torch.cat([context.chunk_positions(24, 3, r) for r in range(3)])
    assert sorted(parts.tolist()) == list(range(24))
    stacked = torch.arange(24)[parts]  # the parts stacked rank after rank
    assert torch.equal(stacked[context._order(24, 3)], torch.arange(24))
    with pytest.raises(ValueError, match="10 positions does not split into 2 x CP = 4"):
        context.chunk_positions(10, 2, 0)


@pytest.mark.slow
def test_attention_over_two_cp_ranks_equals_one_process(tmp_path):
    """CP=2 over gloo, float64: the causal attention of each rank's queries over the
    gathered keys and values (with a padding mask, a left-padded row included, and
    without: each chunk under a lower-right causal bias) and the gradients of the
    queries, keys and values - summed over the ranks whose queries read them - equal
    plain SDPA over the whole sequence. Catches a wrong chunk order, a mask of local
    instead of global positions, and key gradients not summed over the CP ranks."""
    torchrun(os.path.join(WORKERS, "cp_attention.py"), 2, str(tmp_path))
    out = torch.load(tmp_path / "cp_attention.pt", weights_only=True)
    for case in ("padded", "causal"):
        for key in ("out", "q", "k", "v"):
            torch.testing.assert_close(out[case][key], out[case + "_reference"][key],
                                       rtol=1e-10, atol=1e-10, msg=f"{case} {key}")


# ------------------------------------------------------------------ whole runs at CP=2

def _metrics(runs, name) -> list[dict]:
    from megarlhf.engine.metrics import read_metrics
    return read_metrics(os.path.join(str(runs), name))


def _follows(one: list[dict], two: list[dict], tol: float) -> None:
    """Two runs' metrics (but timings, speeds and memory) agree within ``tol``,
    relative."""
    assert len(one) == len(two) > 1
    for a, b in zip(one, two, strict=True):
        for key, value in a.items():
            if key.startswith(("timing/", "perf/", "memory/")) or not isinstance(
                    value, (int, float)):
                continue
            assert abs(value - b[key]) <= tol * max(1.0, abs(value)), (a["step"], key, value,
                                                                      b[key])


def _sft(tiny, runs, name, *extra):
    """An SFT command on the tiny task, its run in ``runs`` (never in the shared tiny
    folder, which a resumed run would read back)."""
    out, task, common = tiny
    return ["sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
            "checkpoint.save_interval=0", "run.deterministic=true", f"run.name={name}",
            *common, f"run.output_dir={runs}", *extra]


_ppo = tiny_ppo_args


@pytest.mark.slow
@pytest.mark.extended
def test_sft_and_ppo_at_cp2_follow_one_process(tiny_checkpoints, tmp_path):
    """SFT (three steps, packed micro-batches: the default) and PPO (two iterations: the
    experience passes of the actor, reference, reward model and critic at CP=2, the
    rollout at CP=1 from the CP=2 actor's weights, the actor's and the critic's updates)
    on two processes at CP=2 equal one process: the losses, gradient norms, rewards, KL
    and every other metric within 1e-6 (SFT) and 1e-5 (PPO). Catches a wrong split or
    gather order, rotary positions of the wrong chunks, gradients not summed over CP (or
    summed twice), a grad norm that counts the CP ranks' copies, and CP ranks writing
    results twice."""
    run_cli(*_sft(tiny_checkpoints, tmp_path, "sft_cp1", "train.max_steps=3"))
    proc = torchrun(_sft(tiny_checkpoints, tmp_path, "sft_cp2", "train.max_steps=3",
                         "parallel.context_parallel_size=2"), 2)
    assert "layout TP=1 PP=1 DP=1 CP=2" in proc.stdout
    _follows(_metrics(tmp_path, "sft_cp1"), _metrics(tmp_path, "sft_cp2"), 1e-6)
    run_cli(*_ppo(tiny_checkpoints, tmp_path, "ppo_cp1"))
    torchrun(_ppo(tiny_checkpoints, tmp_path, "ppo_cp2", "parallel.context_parallel_size=2"), 2)
    _follows(_metrics(tmp_path, "ppo_cp1"), _metrics(tmp_path, "ppo_cp2"), 1e-5)


MOE = ["model.num_layers=2", "model.moe.num_experts=4", "model.moe.top_k=2",
       "model.moe.ffn_hidden_size=32"]


@pytest.mark.slow
@pytest.mark.extended
def test_a_mixture_of_experts_at_cp2_ep2_follows_one_process(tiny_checkpoints, tmp_path):
    """A mixture of experts with its experts split over the two CP ranks (CP=2 x EP=2):
    three SFT steps (padded rows, whose lengths split without lengthening, so every router
    sees the same positions) with a load-balancing loss, a z-loss and DeepSeek-V3's expert
    bias all strong, then a PPO iteration from the one-process checkpoint that records the
    experts of its old log-prob pass and replays them in the updates (``r2``; packed
    micro-batches). Every metric equals one process: within 1e-6 (SFT) and 1e-5 (PPO),
    moe/aux_loss and moe/z_loss included, and moe/routing_mismatch_frac 0 - the CP ranks'
    records put back in position order match the rollout's. (PPO runs without the router
    losses: its packed samples are lengthened to a multiple of 2 x CP, the routers count
    the padding, and the losses' gradients then move the policy apart - measured 0.4%
    and 0.7% apart in the losses.) Catches the auxiliary losses' gradients at 1/CP, routing recorded
    or replayed in the wrong positions, expert-bias counts not summed over the CP ranks,
    and the experts' replicas not counting the CP ranks (their checkpoint then fails)."""
    moe = [*MOE, "model.moe.aux_loss_coeff=1", "model.moe.z_loss_coeff=0.1",
           "model.moe.expert_bias=true", "model.moe.score_function=sigmoid",
           "model.moe.expert_bias_update_rate=0.05", "train.max_tokens_per_micro_batch=null",
           "train.max_steps=3"]
    run_cli(*_sft(tiny_checkpoints, tmp_path, "moe_one", *moe))
    proc = torchrun(_sft(tiny_checkpoints, tmp_path, "moe_cp2", *moe,
                         "parallel.context_parallel_size=2",
                         "parallel.expert_model_parallel_size=2"), 2)
    assert "CP=2 EP=2" in proc.stdout
    one, two = _metrics(tmp_path, "moe_one"), _metrics(tmp_path, "moe_cp2")
    assert all(r["moe/aux_loss"] > 0 and r["moe/z_loss"] > 0 for r in one if "train/loss" in r)
    _follows(one, two, 1e-6)
    ppo = ["ppo.num_iterations=1", "rollout.routing_replay=r2",
           f"ppo.sft_checkpoint={tmp_path}/moe_one/checkpoints",
           "model.moe.aux_loss_coeff=0", "model.moe.z_loss_coeff=0"]
    run_cli(*_ppo(tiny_checkpoints, tmp_path, "moe_ppo_one", *ppo))
    torchrun(_ppo(tiny_checkpoints, tmp_path, "moe_ppo_cp2", *ppo,
                  "parallel.context_parallel_size=2", "parallel.expert_model_parallel_size=2"), 2)
    one, two = _metrics(tmp_path, "moe_ppo_one"), _metrics(tmp_path, "moe_ppo_cp2")
    assert [r["moe/routing_mismatch_frac"] for r in two if "objective/kl" in r] == [0.0]
    _follows(one, two, 1e-5)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
     "parallel.expert_model_parallel_size=2", "parallel.expert_tensor_parallel_size=1"],
    ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
     "parallel.context_parallel_size=2", "parallel.expert_model_parallel_size=2",
     "parallel.expert_tensor_parallel_size=1"]], ids=["tp2_sp_ep2", "tp2_sp_cp2_ep2"])
def test_experts_over_a_split_sequence_follow_one_process(tiny_checkpoints, tmp_path, layout):
    """The mixture of experts of the test above with each sequence split over TP ranks
    (sequence parallelism; 2 processes) and over TP x CP ranks (4 processes): three SFT
    steps equal one process within 1e-6, the router losses and the expert bias's moves
    included. Catches the expert bias counted on each TP rank's part of the sequence
    alone (the TP ranks then move their biases apart; measured 2.6e-4 in the loss by the
    second step before megarlhf summed the counts over TP x DP x CP) and a z-loss logged
    as the sum of the parts' means."""
    moe = [*MOE, "model.moe.aux_loss_coeff=1", "model.moe.z_loss_coeff=0.1",
           "model.moe.expert_bias=true", "model.moe.score_function=sigmoid",
           "model.moe.expert_bias_update_rate=0.05", "train.max_tokens_per_micro_batch=null",
           "train.max_steps=3"]
    run_cli(*_sft(tiny_checkpoints, tmp_path, "one", *moe))
    torchrun(_sft(tiny_checkpoints, tmp_path, "split", *moe, *layout),
             4 if "parallel.context_parallel_size=2" in layout else 2)
    _follows(_metrics(tmp_path, "one"), _metrics(tmp_path, "split"), 1e-6)


@pytest.mark.extended
@pytest.mark.slow
def test_moe_ppo_replaying_the_rollout_at_cp2_follows_one_process(tiny_checkpoints, tmp_path):
    """A mixture-of-experts actor at CP=2 replaying the rollout's routing (``r3``: each CP
    rank its positions of each packed sample) through a whole iteration - every epoch and
    mini-batch of the updates - metric for metric as one process with r3, within 1e-5
    (the router losses off, as in the fast test)."""
    moe = [*MOE, "model.moe.aux_loss_coeff=0.01", "train.max_steps=3"]
    run_cli(*_sft(tiny_checkpoints, tmp_path, "moe_sft", *moe))
    ppo = ["ppo.num_iterations=1", "rollout.routing_replay=r3",
           f"ppo.sft_checkpoint={tmp_path}/moe_sft/checkpoints", "model.moe.aux_loss_coeff=0"]
    run_cli(*_ppo(tiny_checkpoints, tmp_path, "r3_one", *ppo))
    torchrun(_ppo(tiny_checkpoints, tmp_path, "r3_cp2", *ppo,
                  "parallel.context_parallel_size=2"), 2)
    _follows(_metrics(tmp_path, "r3_one"), _metrics(tmp_path, "r3_cp2"), 1e-5)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["train.max_tokens_per_micro_batch=null"],  # padded rows, left-padded prompts
    ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
    ["parallel.pipeline_model_parallel_size=2"],
    ["optimizer.use_distributed_optimizer=true"]],  # DP=2 x CP=2, sharded over both
    ids=["padded", "tp2_sp", "pp2", "dp2_distopt"])
def test_sft_at_cp2_in_combination_follows_one_process(tiny_checkpoints, tmp_path, layout):
    """CP=2 with padded micro-batches, with TP=2 and sequence parallelism, with PP=2, and
    with DP=2 under the distributed optimizer (4 processes but padded): three SFT steps
    equal one process within 1e-6."""
    name = "cp_" + "_".join(o.split("=")[0].rsplit(".", 1)[-1] for o in layout)
    ref = [o for o in layout if o.startswith(("train.", "optimizer."))]
    run_cli(*_sft(tiny_checkpoints, tmp_path, name + "_one", "train.max_steps=3", *ref))
    world = 2 if layout[0].startswith("train.") else 4
    torchrun(_sft(tiny_checkpoints, tmp_path, name, "train.max_steps=3",
                  "parallel.context_parallel_size=2", *layout), world)
    _follows(_metrics(tmp_path, name + "_one"), _metrics(tmp_path, name), 1e-6)


@pytest.mark.extended
@pytest.mark.slow
def test_a_cp2_checkpoint_resumes_at_cp1(tiny_checkpoints, tmp_path):
    """Six SFT steps at CP=2 (distributed optimizer over DP x CP = 2 ranks), resumed at
    CP=1 (plain optimizer) for six more: the steps after the resume follow the unbroken
    one-process run within the resharding tolerance of tests/test_engine.py."""
    common = ("optimizer.lr_schedule=constant", "optimizer.warmup_steps=0",
              "checkpoint.save_interval=6")
    run_cli(*_sft(tiny_checkpoints, tmp_path, "cp_unbroken", "train.max_steps=12", *common))
    torchrun(_sft(tiny_checkpoints, tmp_path, "cp_broken", "train.max_steps=6",
                  "parallel.context_parallel_size=2", *common), 2)
    proc = run_cli(*_sft(tiny_checkpoints, tmp_path, "cp_broken", "train.max_steps=12", *common))
    assert "parallel.context_parallel_size: 2 -> 1" in proc.stdout
    unbroken = {r["step"]: r for r in _metrics(tmp_path, "cp_unbroken") if "train/loss" in r}
    broken = {r["step"]: r for r in _metrics(tmp_path, "cp_broken") if "train/loss" in r}
    for step in range(7, 13):
        assert abs(broken[step]["train/loss"] - unbroken[step]["train/loss"]) < 2e-6, step


LONG = ["rollout.max_new_tokens=4100", "rollout.stop_at_eos=false", "data.max_seq_len=4200",
        *(f"{m}.max_position_embeddings=4200" for m in
          ("model", "roles.critic.model", "roles.reward.model", "roles.reference.model")),
        "ppo.rollout_batch_size=2", "ppo.mini_batch_size=2", "ppo.micro_batch_size=1",
        "ppo.num_eval_prompts=2", "ppo.num_iterations=1", "ppo.eval_interval=1"]


@pytest.mark.extended
@pytest.mark.slow
def test_ppo_with_4k_token_responses_at_cp2_follows_one_process(tiny_checkpoints, tmp_path):
    """A PPO iteration whose responses are 4100 tokens long (no stop token), trained with
    each sequence split over two CP ranks: its metrics (the evaluation's before and after,
    rewards, KL, losses, gradient norms) equal one process within 1e-5."""
    run_cli(*_ppo(tiny_checkpoints, tmp_path, "long_cp1", *LONG))
    torchrun(_ppo(tiny_checkpoints, tmp_path, "long_cp2", *LONG, "parallel.context_parallel_size=2"), 2)
    one, two = _metrics(tmp_path, "long_cp1"), _metrics(tmp_path, "long_cp2")
    assert one[0]["eval/response_len"] == 4100.0
    _follows(one, two, 1e-5)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("stage", ["rm", "dpo", "distill"])
def test_rm_dpo_and_distill_at_cp2_follow_one_process(tiny_checkpoints, tmp_path, stage):
    """Three steps of the reward model (pairs packed by default), DPO (the reference
    resident, at the policy's CP=2) and distillation (the teacher's top-k cache built at
    CP=2) on two processes at CP=2 equal one process within 1e-6. DPO's accuracies are
    left out: at the first steps the policy is the reference and the margins are ~1e-8,
    whose signs rounding decides."""
    out, task, common = tiny_checkpoints
    runs = [f"run.output_dir={tmp_path}", "train.max_steps=3", "checkpoint.save_interval=0",
            "run.deterministic=true"]
    argv = {
        "rm": ["rm", "configs/rm_tiny.yaml", f"data.train_path={task['prefs']}"],
        "dpo": ["dpo", "configs/dpo_tiny.yaml", f"data.train_path={task['prefs']}",
                f"checkpoint.load={out}/sft-tiny/checkpoints", "train.global_batch_size=8",
                "train.micro_batch_size=2", "train.eval_interval=0", "dpo.gold_reward_fn=null",
                "dpo.gold_eval_path=null", "dpo.use_cache=false"],
        "distill": ["distill", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
                    f"distill.teacher_checkpoint={out}/sft-tiny/checkpoints",
                    "model.hidden_size=32", "train.eval_interval=0"]}[stage]
    run_cli(*argv, *common, *runs, "run.name=one", f"cache.path={tmp_path}/cache_one")
    torchrun([*argv, *common, *runs, "run.name=two", f"cache.path={tmp_path}/cache_two",
              "parallel.context_parallel_size=2"], 2)
    one, two = _metrics(tmp_path, "one"), _metrics(tmp_path, "two")
    if stage == "dpo":
        one, two = ([{k: v for k, v in r.items() if "accuracy" not in k} for r in rows]
                    for rows in (one, two))
    _follows(one, two, 1e-6)
