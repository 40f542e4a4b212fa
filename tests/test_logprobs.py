"""Single-process checks of the model pieces against plain torch references."""

import torch

from megarlhf.models.logprobs import vocab_parallel_logprobs


def test_logprobs_entropy_and_grads_match_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 40, (3, 7))
    lp, ent = vocab_parallel_logprobs(logits, target, temperature=0.8, true_vocab=40)
    ref_logits = logits[..., :40] / 0.8
    ref_lsm = torch.log_softmax(ref_logits.double(), -1)
    ref_lp = ref_lsm.gather(-1, target[..., None]).squeeze(-1)
    ref_ent = -(ref_lsm.exp() * ref_lsm).sum(-1)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-6)
    assert torch.allclose(ent.double(), ref_ent, atol=1e-6)
    w1, w2 = torch.randn(3, 7), torch.randn(3, 7)
    (grad,) = torch.autograd.grad((lp * w1).sum() + (ent * w2).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref_lp.float() * w1).sum() + (ref_ent.float() * w2).sum(),
                                      logits)
    assert torch.allclose(grad, ref_grad, atol=1e-5)
    assert grad[..., 40:].abs().max() == 0  # padded vocabulary gets no gradient
    # only one of the two outputs in the loss: the backward skips the other's term
    for use in ("logprob", "entropy"):
        lp, ent = vocab_parallel_logprobs(logits, target, temperature=0.8, true_vocab=40)
        ref_lsm = torch.log_softmax(logits[..., :40].float() / 0.8, -1)
        if use == "logprob":
            ours, ref = (lp * w1).sum(), (ref_lsm.gather(-1, target[..., None]).squeeze(-1)
                                          * w1).sum()
        else:
            ours, ref = (ent * w2).sum(), (-(ref_lsm.exp() * ref_lsm).sum(-1) * w2).sum()
        (g,) = torch.autograd.grad(ours, logits)
        (g_ref,) = torch.autograd.grad(ref, logits)
        assert torch.allclose(g, g_ref, atol=1e-5), use
        assert g[..., 40:].abs().max() == 0


def test_logprob_of_a_target_outside_the_vocabulary_is_minus_log_z():
    """An id no rank holds: -log Z and no one-hot gradient (what the TP path gives)."""
    logits = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([[1, 16, 3], [-1, 0, 15]])
    lp, _ = vocab_parallel_logprobs(logits, target)
    log_z = torch.logsumexp(logits.float(), -1)
    assert torch.allclose(lp[0, 1], -log_z[0, 1]) and torch.allclose(lp[1, 0], -log_z[1, 0])
    assert torch.allclose(lp[0, 0], logits[0, 0, 1].float() - log_z[0, 0])
    (g,) = torch.autograd.grad(lp.sum(), logits)
    p = torch.softmax(logits.float(), -1)
    assert torch.allclose(g[0, 1].float(), -p[0, 1], atol=1e-6)
    assert torch.allclose(g[1, 0].float(), -p[1, 0], atol=1e-6)


def test_cached_rope_is_bitwise_megatrons():
    from megarlhf.models import rope

    torch.manual_seed(0)
    # megatron's RotaryEmbedding: angles (S, 1, 1, d) with the two halves duplicated
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    angles = torch.outer(torch.arange(48, dtype=torch.float32), inv_freq)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    for dtype in (torch.float32, torch.bfloat16):
        for mscale in (1.0, 0.7):
            t = torch.randn(48, 3, 4, 32).to(dtype)
            ours = rope.apply_rotary_pos_emb_bshd(t, freqs, mscale=mscale)
            theirs = rope._megatron_bshd(t, freqs, mscale=mscale)
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
            # a second layer's call uses the cached cos/sin, a decode step's slice its own
            assert torch.equal(rope.apply_rotary_pos_emb_bshd(t, freqs, mscale=mscale), theirs)
            assert torch.equal(rope.apply_rotary_pos_emb_bshd(t[5:6], freqs[5:6], mscale=mscale),
                               theirs[5:6])
    # and the gradients (the roll's backward against megatron's cat and negation)
    t = torch.randn(48, 3, 4, 32, requires_grad=True)
    g = torch.randn(48, 3, 4, 32)
    ours = torch.autograd.grad(rope.apply_rotary_pos_emb_bshd(t, freqs), t, g)[0]
    theirs = torch.autograd.grad(rope._megatron_bshd(t, freqs), t, g)[0]
    assert torch.equal(ours, theirs)
    # halves that differ, and partial rotary dimensions, go to megatron's function
    odd = torch.randn(48, 1, 1, 32)
    t = torch.randn(48, 3, 4, 32)
    assert torch.equal(rope.apply_rotary_pos_emb_bshd(t, odd), rope._megatron_bshd(t, odd))
    t = torch.randn(48, 3, 4, 40)
    assert torch.equal(rope.apply_rotary_pos_emb_bshd(t, freqs), rope._megatron_bshd(t, freqs))


def _attention_case(B, heads, groups, sq, sk, pads, dtype=torch.float64, grad=False):
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    q = torch.randn(B, heads, sq, 8, generator=gen, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, groups, sk, 8, generator=gen, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, groups, sk, 8, generator=gen, dtype=dtype, requires_grad=grad)
    blocked = torch.zeros(B, 1, sq, sk, dtype=torch.bool)  # megatron's: True = blocked
    for b, n in enumerate(pads):  # left padding: the first n keys of row b
        blocked[b, :, :, :n] = True
    return q, k, v, blocked


def test_bmm_attention_equals_sdpa():
    """models/spec._attend_by_bmm (the CPU attention with a mask at up to BMM_MAX_KEYS keys)
    against SDPA with the same boolean mask: training (causal, left padding, pad rows that
    see only themselves), without GQA, a decode step (one query on the cache) and a prefill
    on a cache (queries the last sq of sk); values and gradients in float64."""
    from megarlhf.models import spec

    scale = 8 ** -0.5
    cases = [(3, 4, 2, 12, 12, (0, 3, 11), True), (2, 2, 2, 7, 7, (2, 0), True),
             (3, 4, 2, 1, 9, (0, 4, 8), False), (2, 6, 3, 4, 10, (5, 0), True)]
    for B, heads, groups, sq, sk, pads, causal in cases:
        q, k, v, blocked = _attention_case(B, heads, groups, sq, sk, pads, grad=True)
        ours = spec._attend_by_bmm(q, k, v, spec._bias(blocked, causal, sq, sk, q), scale)
        theirs = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=spec._allowed(blocked, causal, sq, sk, q.device), scale=scale,
            enable_gqa=groups != heads)
        assert ours.shape == theirs.shape and not ours.isnan().any()
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-12), (B, heads, sq, sk)
        g = torch.randn_like(ours)
        for a, b in zip(torch.autograd.grad(ours, (q, k, v), g),
                        torch.autograd.grad(theirs, (q, k, v), g), strict=True):
            assert torch.allclose(a, b, rtol=0, atol=1e-12), (B, heads, sq, sk)
        # the bias is built once per mask tensor: every layer of a forward reuses it
        assert spec._bias(blocked, causal, sq, sk, q) is spec._bias(blocked, causal, sq, sk, q)


def test_sdpa_path_adds_a_kept_mask_bitwise_as_the_boolean_one():
    """SDPACoreAttention.attend's SDPA path gives SDPA the additive mask (0 / -inf in the
    query's dtype, spec._additive) kept on megatron's mask tensor: built once for every
    layer that passes the same mask, again when the mask changes in place, and the output
    bitwise what SDPA gives with the boolean mask (a decode step, a prefill above the bmm
    path's key limit; fp32, fp64, bf16)."""
    from megatron.core.transformer.enums import AttnMaskType

    from megarlhf.models import spec

    core = spec.SDPACoreAttention.__new__(spec.SDPACoreAttention)
    torch.nn.Module.__init__(core)
    core.attn_mask_type, core.heads, core.groups = AttnMaskType.causal, 4, 2
    core.dropout_p, core.softmax_scale = 0.0, 8 ** -0.5
    sk = spec.BMM_MAX_KEYS + 3
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for sq in (1, sk):
            q, k, v, blocked = _attention_case(2, 4, 2, sq, sk, (3, 0), dtype=dtype)
            causal = sq > 1
            boolean = spec._allowed(blocked, causal, sq, sk, q.device)
            out = core.attend(q, k, v, blocked)
            assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=boolean, scale=core.softmax_scale, enable_gqa=True))
            kept = spec._additive(blocked, causal, sq, sk, q)
            assert kept.dtype == dtype
            assert torch.equal(kept == 0, boolean) and torch.equal(kept == -torch.inf, ~boolean)
            core.attend(q, k, v, blocked)  # the next layer
            assert spec._additive(blocked, causal, sq, sk, q) is kept
            blocked[1, :, :, :5] = True  # changed in place: built again
            again = spec._additive(blocked, causal, sq, sk, q)
            assert again is not kept and not torch.equal(again, kept)
            assert torch.equal(core.attend(q, k, v, blocked),
                               torch.nn.functional.scaled_dot_product_attention(
                                   q, k, v, scale=core.softmax_scale, enable_gqa=True,
                                   attn_mask=spec._allowed(blocked, causal, sq, sk, q.device)))


def test_core_attention_takes_bmm_up_to_its_crossover(monkeypatch):
    """SDPACoreAttention.attend runs the bmm attention on CPU with a mask, several queries,
    at most BMM_MAX_KEYS keys (the measured crossover, BENCHMARKS.md round 7) and at most
    BMM_MAX_SCORES scores, in fp32 or fp64; SDPA above either, without a mask, in bf16 and
    for a decode step's single query; both give the same float32 result to rounding."""
    from megatron.core.transformer.enums import AttnMaskType

    from megarlhf.models import spec

    assert spec.BMM_MAX_KEYS == 128
    calls = []
    real = spec._attend_by_bmm
    monkeypatch.setattr(spec, "_attend_by_bmm", lambda *a: calls.append(1) or real(*a))
    core = spec.SDPACoreAttention.__new__(spec.SDPACoreAttention)
    torch.nn.Module.__init__(core)
    core.attn_mask_type, core.heads, core.groups = AttnMaskType.causal, 4, 2
    core.dropout_p, core.softmax_scale = 0.0, 8 ** -0.5
    for sk in (spec.BMM_MAX_KEYS, spec.BMM_MAX_KEYS + 1):
        q, k, v, blocked = _attention_case(2, 4, 2, sk, sk, (3, 0), dtype=torch.float32)
        calls.clear()
        out = core.attend(q, k, v, blocked)
        assert len(calls) == (sk <= spec.BMM_MAX_KEYS)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=spec._allowed(blocked, True, sk, sk, q.device),
            scale=core.softmax_scale, enable_gqa=True)
        assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5)
        calls.clear()
        core.attend(q, k, v, None)  # no mask: SDPA's causal kernel
        core.attend(q[:, :, -1:], k, v, blocked[:, :, -1:])  # a decode step
        assert not calls
    # a score matrix above BMM_MAX_SCORES elements (held for the backward): SDPA
    monkeypatch.setattr(spec, "BMM_MAX_SCORES", 2 * 4 * 64 * 64 - 1)
    q, k, v, blocked = _attention_case(2, 4, 2, 64, 64, (3, 0), dtype=torch.float32)
    core.attend(q, k, v, blocked)
    assert not calls
    monkeypatch.setattr(spec, "BMM_MAX_SCORES", 2 * 4 * 64 * 64)
    core.attend(q, k, v, blocked)
    assert len(calls) == 1
    core.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), blocked)  # bf16: SDPA's fp32 sums
    assert len(calls) == 1
