"""Forward steps in megatron's contract, ``forward_step(data_iterator, model) ->
(output, loss_func)``, shared by every role.

A micro-batch is a dict of tensors: ``tokens`` (B, T), ``position_ids`` (B, T) and an
optional megatron-style ``attention_mask`` (B, 1, T, T), True where attention is blocked.
"""

from __future__ import annotations

from megarlhf.models.logprobs import vocab_parallel_logprobs


def model_forward(model, batch: dict):
    return model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"))


def make_score_step(role: str, *, tp_group, true_vocab: int, temperature: float = 1.0):
    """Forward-only step returning per-token log-probs and entropy of ``tokens[:, 1:]``
    (role ``lm``) or per-token values (role ``value``) from the last stage."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model_forward(model, batch)

        def loss_func(output_tensor, non_loss_data=True):
            if role == "value":
                return {"values": output_tensor.squeeze(-1).float()}  # (B, T)
            logprobs_BT, entropy_BT = vocab_parallel_logprobs(
                output_tensor[:, :-1], batch["tokens"][:, 1:], tp_group=tp_group,
                temperature=temperature, true_vocab=true_vocab)
            return {"logprobs": logprobs_BT, "entropy": entropy_BT}

        return output, loss_func

    return forward_step
