"""Experience making: one call from prompts to an Experience batch, at 1 and 2 processes
and several training/inference layout pairs; offloading on and off; the log-prob cache."""

import os

import pytest
import torch

from conftest import WORKERS, torchrun
from megarlhf.rollout.scoring import SequenceCache
from megarlhf.rewards.verifiers import load_reward_fn

pytestmark = pytest.mark.slow
FIELDS = ["response_tokens_BT", "response_mask_BT", "rollout_logprobs_BT", "old_logprobs_BT",
          "ref_logprobs_BT", "values_BT", "scores_B", "kl_BT", "rewards_BT", "advantages_BT",
          "returns_BT"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("experience"))
    worker = os.path.join(WORKERS, "experience_paths.py")
    torchrun(worker, 1, out)
    torchrun(worker, 2, out)
    return (torch.load(os.path.join(out, "experience_world1.pt"), weights_only=False),
            torch.load(os.path.join(out, "experience_world2.pt"), weights_only=False))


def single(results, offload=True):
    return results[0]["single"][offload]["experience"][0][3]


def test_offloading_does_not_change_experience(results):
    on, off = single(results, True), single(results, False)
    for name in FIELDS:
        assert torch.equal(on[name], off[name]), name
    assert on["scores_B"].std() > 0 and on["advantages_BT"].abs().sum() > 0


def test_forward_micro_batch_size_does_not_change_experience(results):
    """rollout.forward_micro_batch_size: the experience passes in one micro-batch of 8 rows
    instead of four of 2 give the same experience (to matmul rounding)."""
    small, whole = single(results, True), single(results, "mb8")
    for name in FIELDS:
        assert torch.allclose(small[name].float(), whole[name].float(), atol=1e-5), name


def test_cache_hits_return_stored_values(results):
    run = results[0]["single"][True]
    assert run["metrics"]["rollout/ref_cache_hit_rate"] == 0.0
    assert run["metrics2"]["rollout/ref_cache_hit_rate"] == 0.5  # second call: all hits
    assert run["ref_equal_on_hit"]


def test_repeated_sequences_are_scored_once(results):
    """A batch holding every sequence twice: with the cache the reference scores each one
    once (the repeats count as hits) and every row equals the scoring without a cache, at
    one and two processes."""
    for run in (results[0]["single"][True], results[1]["tp2_rollout_tp1x2"][True],
                results[1]["pp2_rollout_tp2"][True]):
        rep = run["repeats"]
        B = rep["rows"]
        assert rep["scored"][0] == list(range(B)) and len(rep["scored"]) == 2
        assert rep["scored"][1] == list(range(2 * B))  # without a cache: every row
        assert rep["hits"] == B
        assert rep["plain"].abs().sum() > 0 and torch.equal(rep["cached"], rep["plain"])


@pytest.mark.parametrize("case", ["tp2_rollout_tp1x2", "pp2_rollout_tp2"])
def test_experience_same_at_other_layouts(results, case):
    ref = single(results)
    # The experience batch is whole on every rank (each trained role takes its own DP
    # share when it learns): every rank's copy equals the single-process one.
    for dp, tp, pp, full in results[1][case][True]["experience"]:
        for name in FIELDS:
            assert torch.allclose(full[name].float(), ref[name].float(), atol=1e-5), \
                (name, dp, tp, pp)
    metrics = results[1][case][True]["metrics"]
    assert metrics["rollout/logprob_diff_max"] < 1e-5 and metrics["perf/reshard_bytes"] > 0
    assert metrics["rollout/response_len_mean"] > 0


def test_old_logprobs_are_the_actors_recomputation(results):
    """rollout.recompute_logprobs=true: the old log-probs are the actor's own pass at its
    training layout, bitwise - not the sampler's (which differ in their last bits: the
    KV-cached decode at the inference layout, so the check can fail)."""
    for world in results:
        for name, variants in world.items():
            for variant, out in variants.items():
                assert out["old_is_recomputed"], (name, variant)
                assert not out["rollout_is_recomputed"], (name, variant)


def test_metrics_present(results):
    metrics = results[0]["single"][True]["metrics"]
    for key in ("timing/reshard", "perf/reshard_bytes", "timing/rollout", "timing/experience",
                "rollout/logprob_diff_mean", "rollout/logprob_diff_max", "objective/score",
                "objective/kl", "rollout/response_len_mean", "rollout/eos_fraction"):
        assert key in metrics, key


def test_sequence_cache_state_round_trip():
    cache = SequenceCache()
    key = SequenceCache.key([1, 2, 3])
    assert key == SequenceCache.key(torch.tensor([1, 2, 3]))  # a list or a tensor of ids
    cache.put(key, torch.tensor([-0.5, -1.25]))
    assert cache.get(SequenceCache.key([1, 2, 4])) is None
    loaded = SequenceCache()
    loaded.load_state_dict(cache.state_dict())
    assert torch.equal(loaded.get(key), torch.tensor([-0.5, -1.25]))
    assert loaded.hit_rate == 0.5  # the miss above travelled with the state


def test_sequence_cache_keeps_the_most_recently_used():
    """rollout.ref_cache_size: at capacity the least recently used sequence (put or hit)
    is dropped, so memory and the checkpointed copy stay bounded; a resume with a smaller
    capacity keeps the most recently used that fit; 0 turns the cache off in PPO."""
    cache = SequenceCache(capacity=3)
    keys = [SequenceCache.key([k]) for k in range(5)]
    for k in keys[:3]:
        cache.put(k, torch.tensor([float(len(k))]))
    assert cache.get(keys[0]) is not None  # used: now the most recent
    cache.put(keys[3], torch.tensor([3.0]))  # drops keys[1], the least recently used
    assert list(cache.store) == [keys[2], keys[0], keys[3]]
    cache.put(keys[4], torch.tensor([4.0]))
    assert list(cache.store) == [keys[0], keys[3], keys[4]]
    assert len(cache.state_dict()["store"]) == 3
    smaller = SequenceCache(capacity=2)
    smaller.load_state_dict(cache.state_dict())
    assert list(smaller.store) == [keys[3], keys[4]]
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        SequenceCache(capacity=0)
    from megarlhf.config import load_config
    with pytest.raises(ValueError, match="rollout.ref_cache_size"):
        load_config(None, ["rollout.ref_cache_size=-1"])


def test_reward_fn_import_errors():
    assert load_reward_fn("megarlhf.data.synthetic:gold_reward")("red blue") > 0
    with pytest.raises(ValueError, match="must look like"):
        load_reward_fn("megarlhf.data.synthetic.gold_reward")
    with pytest.raises(ValueError, match="cannot import reward function"):
        load_reward_fn("megarlhf.data.synthetic:nope")
