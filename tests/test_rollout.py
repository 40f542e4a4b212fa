"""Rollout: resharding into the inference layout, KV-cached generation, sampling filters."""

import os
import random

import pytest
import torch

from conftest import WORKERS, torchrun
from megarlhf.inference.generate import filter_logits, left_pad
from workers.rollout_paths import PROMPTS


@pytest.fixture(scope="module")
def rollout_results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rollout"))
    worker = os.path.join(WORKERS, "rollout_paths.py")
    torchrun(worker, 1, out)
    torchrun(worker, 2, out)
    return (torch.load(os.path.join(out, "rollout_world1.pt"), weights_only=False),
            torch.load(os.path.join(out, "rollout_world2.pt"), weights_only=False))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3"])
def test_kv_cache_greedy_equals_full_recompute(rollout_results, arch):
    gen = rollout_results[0][f"gen_{arch}"]
    cached, full = gen["cached"], gen["full"]
    assert torch.equal(cached.response_tokens_BT, full.response_tokens_BT)
    assert torch.equal(cached.fed_mask_BT, full.fed_mask_BT)
    assert (cached.logprobs_BT - full.logprobs_BT).abs().max() < 1e-5
    assert cached.fed_mask_BT.sum() > 0


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3"])
def test_static_cache_decodes_as_megatrons_context(rollout_results, arch):
    """The fixed-shape KV cache the CUDA-graph decode step runs on (inference/static_kv,
    eager here): greedy and per-row-seeded samples with rows stopping at different
    columns give megatron's context's tokens and stops, log-probs to 1e-5 (the attention
    sums over the whole cache, the unwritten columns masked); its keys and values take
    the bytes megatron's do; afterwards the layers decode as before, bitwise."""
    gen = rollout_results[0][f"gen_{arch}"]
    static, (tail, tail_stats) = gen["static"], gen["tail"]
    for got, want in ((static["greedy"], gen["cached"]), (static["seeded"], tail)):
        assert torch.equal(got.response_tokens_BT, want.response_tokens_BT)
        assert torch.equal(got.fed_mask_BT, want.fed_mask_BT)
        assert torch.equal(got.finished_B, want.finished_B)
        assert (got.logprobs_BT - want.logprobs_BT).abs().max() < 1e-5
    assert len(set(tail.fed_mask_BT.sum(1).tolist())) > 1
    assert static["stats"]["kv_cache_bytes"] == tail_stats["kv_cache_bytes"] > 0
    assert static["stats"]["decode_slots"] == tail_stats["decode_slots"]
    # where CUDA graphs apply: the plain cached generation only
    assert static["auto"] == {"plain": True, "no_cache": False,
                              "routing": False, "interrupt": False}
    after = static["after"]
    assert torch.equal(after.response_tokens_BT, gen["cached"].response_tokens_BT)
    assert torch.equal(after.logprobs_BT, gen["cached"].logprobs_BT)


@pytest.mark.parametrize("rows", [1, 3, 8, 16, 36, 64, 65, 200])
def test_short_matmul_equals_torchs_either_way_round(rows):
    """speedups/linears._matmul: with at most FEW_ROWS rows it multiplies the other way round
    (the weight on the left); the result equals ``input @ weight.T`` to rounding, with
    the same shape, contiguous. Above FEW_ROWS it is torch's matmul, bitwise."""
    from megarlhf.speedups import linears

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 64, generator=gen)
    x = torch.randn(rows, 1, 64, generator=gen).transpose(0, 1)  # (1, rows, 64), decode's
    out = linears._matmul(x, weight)
    expected = torch.matmul(x, weight.t())
    assert out.shape == expected.shape and out.is_contiguous()
    assert linears.FEW_ROWS == 64  # the measured crossover (BENCHMARKS.md, round 6)
    if rows > 64:
        assert torch.equal(out, expected)
    else:
        assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5)
        swapped = torch.mm(weight, x.reshape(rows, 64).t()).t()
        assert torch.equal(out.reshape(rows, 300), swapped)  # the way round it took


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_short_tp1_linears_equal_megatrons(rollout_results, arch):
    """At TP=1 megatron's linears go straight to the matmul (gpt2: biases added inside and
    returned separately): logits without autograd bitwise equal to megatron's own
    forwards (3 x 12 = 36 rows: the weight-on-the-left way round, which this machine's MKL
    sums as the usual one at 16 rows and more), and with autograd the same loss and
    main_grad gradients to rounding; none of megatron's linear functions ran on that path,
    all of them (twice) on megatron's."""
    if f"linears_{arch}" not in rollout_results[0]:
        pytest.skip("speedups.linears is off (MEGARLHF_SPEEDUPS)")
    out = rollout_results[0][f"linears_{arch}"]
    assert torch.equal(out["short"], out["megatron"])
    assert torch.allclose(*out["loss"], rtol=1e-6)
    assert out["grad_scale"] > 0 and out["grad_diff"] <= 1e-5 * out["grad_scale"]
    assert out["linears"] >= 4 * 2 + 1  # qkv, proj, fc1, fc2 per layer, and the head
    assert out["short_calls"] == 0
    assert out["megatron_calls"] == 2 * out["linears"]  # the no-grad and the grad pass


@pytest.mark.slow
def test_kv_cache_at_rollout_tp2_holds_half_the_heads(rollout_results):
    """At rollout TP=2 (heads and vocabulary split over two ranks) each rank's KV cache is
    half of TP=1's."""
    tp1, tp2 = (rollout_results[0]["sample_tp1"].kv_cache_bytes,
                rollout_results[1]["sample_pp2vpp2_to_tp2"].kv_cache_bytes)
    assert tp1 > 0 and tp2 * 2 == tp1  # each TP rank holds half the key/value heads


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3"])
def test_idle_decode_slots_are_the_stopped_rows_fed(rollout_results, arch):
    """rollout/idle_decode_slots counts, at each decode step, the rows fed that had
    stopped: a row of L tokens in a response W wide idles W - L steps, of W - 1."""
    tail, stats = rollout_results[0][f"gen_{arch}"]["tail"]
    lengths = tail.fed_mask_BT.sum(1)
    width = tail.response_tokens_BT.shape[1]
    assert len(set(lengths.tolist())) > 1  # the rows stop at different columns
    assert stats["decode_slots"] == len(lengths) * (width - 1)
    assert stats["idle_decode_slots"] == int((width - lengths).sum()) > 0


def _slot_schedule(lengths: list[int], slots: int) -> tuple[int, int]:
    """(decode slots, idle ones) of continuous batching, simulated from the response
    lengths: each step every busy slot samples a token; a slot whose row is done takes the
    next prompt before the step's decode; a step is counted while any slot is busy."""
    left, waiting = [None] * slots, list(range(len(lengths)))
    for s in range(slots):
        left[s] = lengths[waiting.pop(0)] if waiting else None
    total = idle = 0
    while True:
        left = [None if x is None or x == 1 else x - 1 for x in left]
        left = [lengths[waiting.pop(0)] if x is None and waiting else x for x in left]
        busy = sum(x is not None for x in left)
        if not busy:
            return total, idle
        total, idle = total + slots, idle + slots - busy


@pytest.mark.slow
@pytest.mark.parametrize("how", ["greedy", "seeded"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3"])
def test_continuous_batching_samples_what_the_static_batch_does(rollout_results, arch, how):
    """4 prompts through 2 decode slots (rollout.decode_slots), a freed slot taking the
    next prompt mid-stream: the same tokens, stops and log-probs (to 1e-5) as all four in
    one static batch - greedy, and sampled from per-prompt seeds with rows stopping at
    different columns; its idle slots are the simulated schedule's."""
    static, continuous, stats = rollout_results[0][f"gen_{arch}"]["continuous"][how]
    lengths = static.fed_mask_BT.sum(1).tolist()
    if how == "seeded":  # (greedy, a random model repeats itself: rows may stop alike)
        assert len(set(lengths)) > 1
    assert torch.equal(static.response_tokens_BT, continuous.response_tokens_BT)
    assert torch.equal(static.fed_mask_BT, continuous.fed_mask_BT)
    assert torch.equal(static.finished_B, continuous.finished_B)
    assert torch.equal(static.prompt_tokens_BP, continuous.prompt_tokens_BP)
    assert (static.logprobs_BT - continuous.logprobs_BT).abs().max() < 1e-5
    assert (stats["decode_slots"], stats["idle_decode_slots"]) == _slot_schedule(lengths, 2)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_responses_are_as_wide_as_the_longest(rollout_results, arch):
    """When every row stops early the response columns end at the longest response, and
    the tokens are those of the run without the stop tokens."""
    gen = rollout_results[0][f"gen_{arch}"]
    cached, stopped = gen["cached"], gen["stopped"]
    lengths = stopped.fed_mask_BT.sum(1)
    assert stopped.response_tokens_BT.shape[1] == int(lengths.max()) <= 2
    assert stopped.finished_B.all()
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(stopped.response_tokens_BT[b, :n], cached.response_tokens_BT[b, :n])
        assert torch.equal(stopped.logprobs_BT[b, :n], cached.logprobs_BT[b, :n])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3"])
def test_sampled_logprobs_equal_teacher_forced_scoring(rollout_results, arch):
    """Left padding and position ids do not change anything: the sampler's log-probs of a
    batch of unequal prompts equal the log-probs of each sequence scored alone."""
    gen = rollout_results[0][f"gen_{arch}"]
    sampled = gen["sampled"]
    for b, prompt in enumerate(PROMPTS):
        n = int(sampled.fed_mask_BT[b].sum())
        teacher = gen["teacher"][b][len(prompt) - 1:len(prompt) - 1 + n]
        assert len(teacher) == n
        diff = (torch.tensor(teacher) - sampled.logprobs_BT[b, :n]).abs().max()
        assert diff < 1e-5, (b, diff)
    assert (sampled.fed_mask_BT.sum(1) > 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tp2_to_tp1x2", "pp2_to_tp2", "tp1pp2_to_tp1x2",
                                  "pp2vpp2_to_tp2", "qwen3_pp2vpp2_to_tp2",
                                  "olmo3_tp2_to_tp1x2"])
def test_reshard_reproduces_training_logprobs(rollout_results, case):
    """The rollout's weights after a reshard (before and after an optimizer step) score as
    the training layout does, within 1e-5; olmo3: OLMo 3's all-heads q/k norm weight
    (split over the training TP) and its windows, gathered for rollout TP=1."""
    phases = rollout_results[1][case]
    for phase in ("initial", "after_step"):
        d = phases[phase]
        for rank_rows in d["inference"]:  # every replica / TP rank
            diff = max(abs(x - y) for row, inf in zip(d["train"], rank_rows, strict=True)
                       for x, y in zip(row["logprobs"], inf, strict=True))
            assert diff < 1e-5, (case, phase, diff)
        assert d["bytes"] > 0
    moved = max(abs(x - y) for a, b in zip(phases["initial"]["train"], phases["after_step"]["train"], strict=True)
                for x, y in zip(a["logprobs"], b["logprobs"], strict=True))
    assert moved > 1e-3  # the optimizer step changed the weights, and the reshard followed


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_reshard_from_vpp_samples_as_tp1(rollout_results, arch):
    """Resharding from an interleaved actor (PP=2 x VPP=2) into rollout TP=2 samples the
    same tokens, with the same log-probs, as TP=1 (same seeded weights, same row seeds);
    qwen3: q/k norms and a head size of its own split over the rollout's TP."""
    prefix = "sample_" if arch == "llama" else f"sample_{arch}_"
    ref = rollout_results[0][f"{prefix}tp1"]
    got = rollout_results[1][f"{prefix}pp2vpp2_to_tp2"]
    assert torch.equal(ref.response_tokens_BT, got.response_tokens_BT)
    assert torch.equal(ref.fed_mask_BT, got.fed_mask_BT)
    assert (ref.logprobs_BT - got.logprobs_BT).abs().max() < 1e-5
    assert ref.fed_mask_BT.sum() > 4
    # the static cache at rollout TP=2 (each rank its half of the heads) samples as TP=1
    assert torch.equal(ref.response_tokens_BT, got.static.response_tokens_BT)
    assert (ref.logprobs_BT - got.static.logprobs_BT).abs().max() < 1e-5


def reference_filter(logits, top_k, top_p):
    """Plain-Python top-k then top-p (nucleus) filter for one row."""
    values = logits.tolist()
    order = sorted(range(len(values)), key=lambda i: -values[i])
    keep = set(order[:top_k] if top_k else order)
    kept_sorted = [i for i in order if i in keep]
    m = max(values[i] for i in kept_sorted)
    exps = {i: torch.tensor(values[i] - m).exp().item() for i in kept_sorted}
    total = sum(exps.values())
    nucleus, mass = set(), 0.0
    for i in kept_sorted:
        if mass >= top_p:
            break
        nucleus.add(i)
        mass += exps[i] / total
    return nucleus


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (5, 1.0), (5, 0.5), (1, 1.0), (0, 0.0001)])
def test_top_k_top_p_match_reference(top_k, top_p):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(top_k * 10 + int(top_p * 100)))
    filtered = filter_logits(logits, top_k, top_p)
    for b in range(logits.shape[0]):
        kept = {i for i in range(40) if filtered[b, i] > -1e29}
        assert kept == reference_filter(logits[b], top_k, top_p)
        assert logits[b].argmax().item() in kept


def test_left_pad():
    tokens, mask = left_pad([[1, 2, 3], [4]], pad_id=0)
    assert tokens.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        left_pad([[1], []], 0)


def test_seeded_draws_are_per_token_draws_of_each_sequences_generator():
    """The Gumbel sampler's uniforms, drawn 8 tokens at a time per sequence, are the stream
    of one ``rand(V)`` per token from each sequence's own seeded generator, across chunk
    ends - all rows in step (a static batch) or any of them at a time (decode slots)."""
    from megarlhf.inference.generate import SeededDraws

    seeds, vocab = [3, 11, 3, 5], 13
    draws = SeededDraws(seeds, vocab, torch.device("cpu"))
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    rng = random.Random(0)
    for step in range(40):
        rows = list(range(len(seeds))) if step < 19 else \
            sorted(rng.sample(range(len(seeds)), rng.randint(1, len(seeds))))
        expected = torch.stack([torch.rand(vocab, generator=gens[i]) for i in rows])
        assert torch.equal(draws.next(rows), expected)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["static", "slots"])
@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_partial_rollout_tokens_carry_their_version_and_behaviour_logprob(rollout_results,
                                                                          how, kv):
    """rollout.placement.partial: new weights arrive after the third decode step (a static batch, or
    2 decode slots). Every token records the version that sampled it - 0 up to the
    switch, 1 after it, never back - and its log-prob is that version's: teacher-forced
    scoring by the old weights for version 0, by the new for version 1 when the keys and
    values are recomputed; with them kept, a one-row loop of megatron's inference context
    whose prefix the old weights fed (static batch). The tokens before the switch are the
    unswapped run's. Catches a swap at the wrong step, versions recorded for the wrong
    tokens, and a recompute that leaves the old keys and values (or a keep that drops
    them)."""
    cases = rollout_results[0]["partial_llama"]
    case, unswapped = cases[(how, kv)], cases["unswapped"]
    g = case["gen"]
    mask = g.fed_mask_BT.bool()
    assert set(g.versions_BT[mask].tolist()) == {0, 1}
    assert (g.versions_BT[~mask] == 0).all()
    for b, prompt in enumerate(PROMPTS):
        n = int(mask[b].sum())
        versions, lp = g.versions_BT[b, :n], g.logprobs_BT[b, :n]
        assert (versions[1:] >= versions[:-1]).all(), (b, versions)
        if how == "static":  # the interrupt after decode step 3: tokens 0-2 were sampled
            assert versions.tolist() == [0] * min(n, 3) + [1] * max(0, n - 3)
        old = torch.tensor(case["old"][b][len(prompt) - 1:len(prompt) - 1 + n])
        new = torch.tensor(case["new"][b][len(prompt) - 1:len(prompt) - 1 + n])
        first = int((versions == 0).sum())
        assert first == n or (versions[first:] == 1).all()
        assert torch.allclose(lp[:first], old[:first], rtol=0, atol=1e-5), (b, lp, old)
        # the tokens before the switch are those the old weights alone sample
        m = min(first, int(unswapped.fed_mask_BT[b].sum()))
        assert torch.equal(g.response_tokens_BT[b, :m], unswapped.response_tokens_BT[b, :m])
        if first == n:
            continue
        # the two versions' log-probs differ: the check below can tell them apart
        assert (new[first:] - old[first:]).abs().max() > 1e-3
        if kv == "recompute":
            assert (lp[first:] - new[first:]).abs().max() < 1e-5, (b, lp, new)
        elif how == "static":
            kept = torch.tensor(case["kept"][b])
            assert (lp - kept).abs().max() < 1e-5, (b, lp, kept)
            assert (lp[first:] - new[first:]).abs().max() > 1e-4  # not a recompute
