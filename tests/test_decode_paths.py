"""Decode paths against the plain one: a group's prompt prefilled once
(speedups.shared_prefill), and decode slots recording a mixture of experts' routing."""

import os

import pytest
import torch

from conftest import WORKERS, torchrun

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("shared"))
    worker = os.path.join(WORKERS, "decode_paths.py")
    for world in (1, 2):
        torchrun(worker, world, out)
    return {world: torch.load(os.path.join(out, f"decode_world{world}.pt"), weights_only=False)
            for world in (1, 2)}


@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
@pytest.mark.parametrize("case", ["greedy", "seeded"])
def test_shared_prefill_samples_what_every_row_prefilled_does(shared, world, arch, case):
    """Ten prompts, three groups of three and a lone one, sampled with each group's prompt
    prefilled once and with every row prefilled: the same tokens, masks and stops, the
    log-probs within 1e-6 (measured: equal, or 4.8e-7 apart - the prefill's matmuls see
    fewer rows, which this machine's BLAS may sum in another order), and for a mixture
    of experts the same routing record (prompt columns included), at rollout TP=1 and
    TP=2. Catches a group's keys and values copied to the
    wrong rows (a row then continues another prompt), columns left uncopied, logits not
    handed to every row of a group, and routing recorded for the fed rows only."""
    got = shared[world][(arch, case)]
    plain, fast = got[False], got[True]
    for field in ("response_tokens_BT", "fed_mask_BT", "finished_B"):
        assert torch.equal(getattr(fast, field), getattr(plain, field)), field
    assert (fast.logprobs_BT - plain.logprobs_BT).abs().max() <= 1e-6
    if arch == "qwen3moe":
        assert torch.equal(fast.routing_BLSK, plain.routing_BLSK)
    # the groups sampled different responses (else a lost copy could pass unseen)
    assert not torch.equal(plain.response_tokens_BT[0], plain.response_tokens_BT[1]) \
        or case == "greedy"
    assert got["stats"]["shared_prefills"] == 6  # three groups of three: two rows each


@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("case", ["greedy", "seeded"])
def test_shared_prefill_in_decode_slots_samples_what_every_slot_prefilled_does(shared, world,
                                                                              case):
    """The same ten prompts through four decode slots: the first four slots' repeated
    prompt prefilled once, and a prompt admitted at the same step as its twin taking the
    twin's keys and values, against every slot prefilled - the same tokens, masks and
    stops, log-probs within 1e-6. Catches a twin's copy from the wrong slot or columns."""
    got = shared[world][("llama", case)]["slots"]
    plain, fast = got[False], got[True]
    # the first fill's two twins of the first prompt, and later twins admitted together
    assert got["stats"]["shared_prefills"] > 2, got["stats"]
    for field in ("response_tokens_BT", "fed_mask_BT", "finished_B"):
        assert torch.equal(getattr(fast, field), getattr(plain, field)), field
    assert (fast.logprobs_BT - plain.logprobs_BT).abs().max() <= 1e-6


@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("case", ["greedy", "seeded"])
def test_decode_slots_record_the_experts_the_static_batch_records(shared, world, case):
    """A mixture of experts through four decode slots (``rollout.decode_slots``) with its
    routing recorded, against the static batch: the same tokens, and the same experts for
    every token both fed - each prompt's tokens and every response token but the last
    (a static batch feeds a stopped row's stop token while others go on; slots do not,
    and no pass reads it). Catches choices recorded into another prompt's row or column
    (a slot's earlier occupant, a prompt admitted mid-batch) and columns left unrouted."""
    got = shared[world][("qwen3moe", case)]
    static, slots = got[False], got["slots_routing"]
    for field in ("response_tokens_BT", "fed_mask_BT", "finished_B"):
        assert torch.equal(getattr(slots, field), getattr(static, field)), field
    P = static.prompt_tokens_BP.shape[1]
    fed = torch.cat([static.prompt_mask_BP, static.fed_mask_BT], dim=1).bool()
    last = static.fed_mask_BT.sum(1) - 1  # each row's last response token
    fed[torch.arange(fed.shape[0]), P + last] = False
    assert fed[:, P:].any()  # responses' tokens are compared, not only prompts'
    for b in range(fed.shape[0]):
        assert torch.equal(slots.routing_BLSK[b][:, fed[b]], static.routing_BLSK[b][:, fed[b]]), b


@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("case", ["greedy", "seeded"])
def test_shared_prefill_on_the_static_cache_samples_what_every_row_prefilled_does(
        shared, world, case):
    """The same ten prompts on the fixed-shape cache the CUDA-graph decode step runs on
    (inference/static_kv, eager here): a group's prompt prefilled once and spread to its
    rows' buffers, against every row prefilled - the same tokens, masks and stops,
    log-probs within 1e-6, and the plain static cache's samples equal megatron context's
    tokens. Catches a spread that leaves rows' buffers unwritten or from another group."""
    got = shared[world][("llama", case)]
    plain, fast = got["static"][False], got["static"][True]
    for field in ("response_tokens_BT", "fed_mask_BT", "finished_B"):
        assert torch.equal(getattr(fast, field), getattr(plain, field)), field
        assert torch.equal(getattr(plain, field), getattr(got[False], field)), field
    assert (fast.logprobs_BT - plain.logprobs_BT).abs().max() <= 1e-6


def _same_samples(got, want, tol: float = 1e-5) -> None:
    for field in ("response_tokens_BT", "fed_mask_BT", "finished_B", "prompt_tokens_BP"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert (got.logprobs_BT - want.logprobs_BT).abs().max() <= tol


def _same_routing(got, want) -> None:
    """The experts of every token both fed (a stopped row's stop token is not fed)."""
    P = want.prompt_tokens_BP.shape[1]
    fed = torch.cat([want.prompt_mask_BP, want.fed_mask_BT], dim=1).bool()
    last = want.fed_mask_BT.sum(1) - 1
    fed[torch.arange(fed.shape[0]), P + last] = False
    for b in range(fed.shape[0]):
        assert torch.equal(got.routing_BLSK[b][:, fed[b]], want.routing_BLSK[b][:, fed[b]]), b


@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
@pytest.mark.parametrize("case", ["greedy", "seeded"])
@pytest.mark.parametrize("pool", ["default", "small", "unshared"])
def test_the_paged_cache_samples_what_the_static_batch_does(shared, world, arch, case, pool):
    """Ten prompts through four decode slots on the paged KV cache (rollout.kv_cache=paged)
    against one static batch: the same tokens, masks and stops, log-probs within 1e-5
    (measured: at most 9.5e-7), a mixture of experts' routing for every token fed - with
    the default pool, with six 4-token blocks (prompts wait for blocks and slots are
    preempted and come back: measured 13-15 preemptions) and without shared prefill in
    3-token blocks. Catches a key written at the wrong block or offset (a slot then reads
    another's tokens), a block freed while a twin still shares it, a preempted prompt's
    tokens or draws lost, the rotary angle of the wrong position, and the routing of a
    prefill's padding recorded over a prompt's columns."""
    got = shared[world][(arch, case)]
    static = got[False]
    paged, stats = got["paged"][pool]
    _same_samples(paged, static)
    if arch == "qwen3moe":
        _same_routing(paged, static)
    if pool == "small":
        assert stats["kv_preemptions"] > 0 and stats["kv_blocks_peak"] <= 6, stats
        # 24 positions against the default's four slots of one 16-token block
        assert stats["kv_cache_bytes"] * 64 == got["paged"]["default"][1]["kv_cache_bytes"] * 24
    elif pool == "default":  # twins share their prompt's whole blocks: fewer than one each
        assert stats["shared_prefills"] > 0 and stats["kv_preemptions"] == 0
    else:
        assert stats["shared_prefills"] == 0


@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "kept"])
def test_new_weights_mid_batch_sample_on_the_paged_cache_what_the_columns_do(shared, world,
                                                                              arch, recompute):
    """Partial rollouts' new weights before the fourth decode step (every parameter x 1.5),
    with the keys and values computed again (rollout.placement.partial_kv=recompute) or
    kept: the paged cache samples the columns cache's tokens, versions and log-probs
    (1e-5). Catches a recompute that loses a slot's sampled tokens or feeds them twice, and
    a kept cache cleared."""
    got = shared[world][(arch, "seeded")]["paged"]
    paged, columns = got[("swap", recompute, "paged")], got[("swap", recompute, "columns")]
    _same_samples(paged, columns)
    assert torch.equal(paged.versions_BT, columns.versions_BT)
    assert paged.versions_BT.max() == 1 and paged.versions_BT.min() == 0
    # the new weights changed what was sampled (else a lost swap could pass unseen)
    plain = shared[world][(arch, "seeded")][False]
    assert not torch.equal(paged.response_tokens_BT, plain.response_tokens_BT)


@pytest.mark.parametrize("case", ["greedy", "seeded"])
def test_the_compiled_decode_step_samples_what_the_eager_one_does(shared, case):
    """The static cache's decode step through torch.compile (speedups.compiled_decode,
    compiled from the first step) against the same step eager: every step ran compiled,
    the same tokens, masks and stops, log-probs within 1e-5 (measured: at most 4.8e-7).
    Catches a compiled step that reads a stale column, token or mask (its buffers are
    updated in place between steps) and a compile that silently fell back to eager.
    (Rollout TP=2 compiles too: checked by hand, not in this tier - a second compile
    costs 20 s.)"""
    got = shared[1][("llama", case)]["compiled"]
    assert got["steps"] > 0
    _same_samples(got["compiled"], got["eager"])


def test_rollout_replicas_take_whole_groups():
    """Rollout replicas take contiguous runs of the batch (``RankLayout.run_share``, what
    ``gather_generations`` puts back in order): every sample once and in order, the runs
    within one sample of each other, and with 16 samples in groups of 4 each of two
    replicas holds two whole groups - so each prefills a group's prompt once
    (speedups.shared_prefill). Catches the strided share (every other sample: each replica
    sees groups of 2) and runs that skip or repeat a sample."""
    from megarlhf.parallel.layout import run_of

    for n in range(20):
        for parts in (1, 2, 3, 4):
            runs = [run_of(n, parts, p) for p in range(parts)]
            assert [i for run in runs for i in run] == list(range(n))
            assert max(map(len, runs)) - min(map(len, runs)) <= 1
    for p in range(2):
        groups = [i // 4 for i in run_of(16, 2, p)]
        assert sorted(groups.count(g) for g in set(groups)) == [4, 4]
