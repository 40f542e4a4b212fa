"""Single-process checks of the model pieces against plain torch references."""

import os

import pytest
import torch

from conftest import WORKERS, torchrun
from megarlhf.memory.accounting import ActivationMeter
from megarlhf.models.logprobs import head_logprobs, vocab_parallel_logprobs


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


def test_chunks_give_the_same_numbers_and_keep_only_the_logits():
    """Log-probs, entropy and gradients a position at a time, 7 at a time and all at once
    are the same numbers (bitwise: the same arithmetic per position), and the backward
    keeps only the logits given - bf16 here - not fp32 copies, the softmax and its log
    (which were twice the fp32 logits)."""
    torch.manual_seed(1)
    raw = torch.randn(2, 64, 300, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 290, (2, 64))
    w1, w2 = torch.randn(2, 64), torch.randn(2, 64)
    got = {}
    for chunk in (1, 7, None):
        logits = raw * 1.0  # a non-leaf, as a model's output is
        with ActivationMeter() as meter:
            lp, ent = vocab_parallel_logprobs(logits, target, temperature=0.9, true_vocab=290,
                                              chunk=chunk)
        assert meter.peak <= logits.numel() * 2 + 4096, (chunk, meter.peak)
        (grad,) = torch.autograd.grad((lp * w1).sum() + (ent * w2).sum(), raw)
        got[chunk] = (lp, ent, grad)
    for chunk in (1, 7):
        assert all(torch.equal(a, b) for a, b in zip(got[chunk], got[None])), chunk


def test_the_head_a_chunk_at_a_time_equals_the_logits_path_and_keeps_no_logits():
    """``head_logprobs`` (the LM head's matmul inside the chunks) against the head's logits
    through ``vocab_parallel_logprobs``: log-probs, entropy and the gradients of the hidden
    states and of the head's weight within 1e-6, in chunks of 1, 7 and all positions; and
    what the backward keeps in chunks is the hidden states it was given, not the positions
    x vocabulary logits (the weight is a parameter: not counted), while positions that fit
    one chunk keep their logits too (one chunk's, and no second matmul)."""
    torch.manual_seed(2)
    B, T, H, V = 2, 40, 16, 300
    raw = torch.randn(B, T, H, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(V, H) * 0.3)
    target = torch.randint(0, 290, (B, T))
    w1, w2 = torch.randn(B, T), torch.randn(B, T)
    hidden = raw * 1.0
    lp, ent = vocab_parallel_logprobs(torch.nn.functional.linear(hidden, weight), target,
                                      temperature=0.9, true_vocab=290)
    want = (lp, ent, *torch.autograd.grad((lp * w1).sum() + (ent * w2).sum(), (raw, weight)))
    for chunk in (1, 7, None):
        hidden = raw * 1.0
        with ActivationMeter(exclude=[weight]) as meter:
            lp, ent = head_logprobs(hidden, weight, target, temperature=0.9, true_vocab=290,
                                    chunk=chunk)
        logits = 0 if chunk else B * T * V * 4
        assert logits + hidden.numel() * 4 <= meter.peak <= logits + hidden.numel() * 4 + 4096, \
            (chunk, meter.peak)
        got = (lp, ent, *torch.autograd.grad((lp * w1).sum() + (ent * w2).sum(),
                                             (raw, weight)))
        for name, a, b in zip(("logprobs", "entropy", "hidden grad", "weight grad"), got, want):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-6), (chunk, name,
                                                               float((a - b).abs().max()))
    # the logits path keeps the logits: the saving is real
    with ActivationMeter(exclude=[weight]) as meter:
        vocab_parallel_logprobs(torch.nn.functional.linear(raw * 1.0, weight), target)
    assert meter.peak >= B * T * V * 4


def test_several_ids_a_chunk_at_a_time_equal_the_logits_path_and_keep_no_logits():
    """``head_gather_logprobs`` (distillation's student log-probs of the teacher's top-k
    ids) against the head's logits through ``vocab_parallel_gather_logprobs``: the
    log-probs and the gradients of the hidden states and the weight within 1e-6 in chunks
    of 1, 7 and all positions (temperature, padded vocabulary, an id repeated); what the
    chunked backward keeps is the hidden states, the one-chunk one's also the logits."""
    from megarlhf.models.logprobs import head_gather_logprobs, vocab_parallel_gather_logprobs
    torch.manual_seed(3)
    B, T, H, V, K = 2, 40, 16, 300, 5
    raw = torch.randn(B, T, H, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(V, H) * 0.3)
    ids = torch.randint(0, 290, (B, T, K))
    ids[..., 1] = ids[..., 0]
    w = torch.randn(B, T, K)
    lp = vocab_parallel_gather_logprobs(torch.nn.functional.linear(raw * 1.0, weight), ids,
                                        temperature=0.9, true_vocab=290)
    want = (lp, *torch.autograd.grad((lp * w).sum(), (raw, weight)))
    for chunk in (1, 7, None):
        hidden = raw * 1.0
        with ActivationMeter(exclude=[weight]) as meter:
            lp = head_gather_logprobs(hidden, weight, ids, temperature=0.9, true_vocab=290,
                                      chunk=chunk)
        logits = 0 if chunk else B * T * V * 4
        assert logits + hidden.numel() * 4 <= meter.peak \
            <= logits + hidden.numel() * 4 + ids.numel() * 8 + 4096, (chunk, meter.peak)
        got = (lp, *torch.autograd.grad((lp * w).sum(), (raw, weight)))
        for name, a, b in zip(("logprobs", "hidden grad", "weight grad"), got, want):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-6), (chunk, name,
                                                               float((a - b).abs().max()))


@pytest.mark.extended
@pytest.mark.slow
def test_chunked_logprobs_at_tp2_equal_the_full_vocabulary(tmp_path):
    """At TP=2, in chunks of 3 positions and in one: log-probs, entropy and gradients
    (temperature 0.7, padded vocabulary) equal each other and plain torch on the full
    logits in float64; and so do the head's a chunk at a time (``head_logprobs``: the
    gradients of the hidden states, summed over TP, and of the weight's shards), and
    several ids' log-probs per position that way (``head_gather_logprobs``)."""
    torchrun(os.path.join(WORKERS, "logprob_chunks.py"), 2, str(tmp_path))
    out = torch.load(tmp_path / "logprob_chunks.pt", weights_only=False)
    ref = out["reference"]
    for key in ("logprobs", "entropy", "grad"):
        assert torch.equal(out[3][key], out[10**9][key]), key
        assert torch.allclose(out[3][key].double(), ref[key].double(), atol=1e-5), key
    head = out["head_reference"]
    for chunk in (3, 10**9):
        for key in ("logprobs", "entropy", "hidden_grad", "weight_grad"):
            assert torch.allclose(out[("head", chunk)][key].double(), head[key].double(),
                                  atol=1e-5), (chunk, key)
    gather = out["gather_reference"]
    for chunk in (3, 10**9):
        for key in ("logprobs", "hidden_grad", "weight_grad"):
            assert torch.allclose(out[("gather", chunk)][key].double(), gather[key].double(),
                                  atol=1e-5), (chunk, key)
