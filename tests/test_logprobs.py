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
