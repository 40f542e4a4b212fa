"""GPU-only paths: TransformerEngine layer spec and fp8. Marked ``gpu`` (skipped without
CUDA); the CPU rejection messages are tested everywhere."""

import pytest
import torch

from megarlhf.config import load_config
from megarlhf.models.spec import resolve_impl, transformer_engine_available


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rejection")
def test_fp8_and_te_rejected_without_cuda():
    cfg = load_config(None, ["model.fp8.enabled=true", "model.params_dtype=bfloat16"])
    with pytest.raises(ValueError, match="needs TransformerEngine and a CUDA GPU"):
        resolve_impl(cfg.model)
    cfg = load_config(None, ["model.transformer_impl=transformer_engine"])
    with pytest.raises(ValueError, match="TransformerEngine cannot be used here"):
        resolve_impl(cfg.model)
    assert resolve_impl(load_config(None).model) == "local"


@pytest.mark.gpu
def test_te_spec_fp8_forward_single_gpu():
    if not transformer_engine_available():
        pytest.skip("TransformerEngine is not installed (pip install -e .[fp8])")
    import torch.distributed as dist

    from megarlhf.engine.role_specs import single_role_spec
    from megarlhf.engine.roles import build_role
    from megarlhf.models.logprobs import vocab_parallel_logprobs
    from megarlhf.parallel.launch import init_distributed, shutdown

    cfg = load_config(None, [
        "model.vocab_size=256", "model.hidden_size=128", "model.num_attention_heads=4",
        "model.num_layers=2", "model.params_dtype=bfloat16", "model.fp8.enabled=true",
        "model.fp8.recipe=delayed", "model.fp8.amax_history_len=16"])
    assert resolve_impl(cfg.model) == "transformer_engine"
    spec = single_role_spec(cfg, name="model", kind="lm", world_size=1, trained=False)
    init_distributed(cfg)
    try:
        role = build_role(spec, seed=cfg.run.seed)
        layout, (model,) = role.layout, role.chunks
        model.cuda()
        tokens = torch.randint(0, 256, (2, 32), device="cuda")
        pos = torch.arange(32, device="cuda").expand(2, -1)
        logits = model(tokens, pos, None)
        logprobs, _ = vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:],
                                              tp_group=layout.tp_group, true_vocab=256)
        assert torch.isfinite(logprobs).all()
        assert dist.get_backend() == "nccl"
    finally:
        shutdown()
