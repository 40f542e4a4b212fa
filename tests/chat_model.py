"""A tiny Hugging Face Llama with a byte-level BPE tokenizer and a ChatML chat template,
saved as a model directory the way a user brings one (transformers is a test oracle)."""

from __future__ import annotations

import os

from megarlhf.data.synthetic import CHATML, write_chat_task

SPECIAL = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"]


def make_chat_model(folder: str, seed: int = 0) -> dict:
    """``folder``/hf: config, random weights, tokenizer.json, tokenizer_config.json with
    the chat template; ``folder``/data: the chat task. Returns paths."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    data = write_chat_task(os.path.join(folder, "data"), seed=seed)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = data.pop("corpus") + ["user", "assistant", "system", "words:"] * 50
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>",
        chat_template=CHATML)
    hf = os.path.join(folder, "hf")
    fast.save_pretrained(hf)
    vocab = tok.get_vocab_size()
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    return {"hf": hf, "tokenizer": fast, **data}
