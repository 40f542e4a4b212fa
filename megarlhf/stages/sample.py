"""``megarlhf generate``: sample from any checkpoint at any layout - the quick look.

The checkpoint's policy (or ``--role``) is built at the training layout (``parallel.*``),
resharded into the inference layout (``rollout.tensor_parallel_size``, the rest of the
world data-parallel replicas) and sampled with the rollout settings (``rollout.*``), in
batches; each replica takes every DP-th prompt, rank 0 writes the rows in input order.

Input: JSONL rows with ``messages`` (rendered with the chat template and its generation
prompt), ``prompt`` (text, encoded as training text rows are) or ``tokens`` (ids); a line
that is not JSON is a text prompt. Output: one JSON row per prompt with the prompt and
response texts, the response's token ids, whether it ended with a stop token, and its
sampling log-probability.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from megarlhf.config import Config, ConfigError, Written
from megarlhf.parallel.rank import is_first
from megarlhf.stages.common import progress
from megarlhf.algos.seeds import derive_seed


def _log(text: str) -> None:
    """Progress notes go to stderr: stdout may be the JSONL output."""
    if is_first():
        print(text, file=sys.stderr, flush=True)

def read_prompts(path: str, tokenizer) -> list[tuple[str, list[int]]]:
    """(prompt text, token ids) per input line."""
    from megarlhf.data.chat import check_messages
    from megarlhf.data.datasets import text_lines

    out = []
    for line_no, line in text_lines(path):
        if not line.strip():
            continue
        where = f"{'stdin' if path == '-' else path} line {line_no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = {"prompt": line.rstrip("\n")}
        if not isinstance(row, dict):
            row = {"prompt": str(row)}
        if "messages" in row:
            template = getattr(tokenizer, "chat_template", None)
            if template is None:
                raise ValueError(f"{where}: 'messages' needs a chat template "
                                 "(tokenizer.chat_template)")
            messages = check_messages(row["messages"], f"{where} 'messages'",
                                      needs_assistant=False)
            text = template.render(messages, add_generation_prompt=True)
            out.append((text, tokenizer.encode(text)))
        elif "tokens" in row:
            ids = [int(t) for t in row["tokens"]]
            out.append((tokenizer.decode(ids), ids))
        elif "prompt" in row and isinstance(row["prompt"], str):
            out.append((row["prompt"], tokenizer.encode(
                row["prompt"], add_bos=getattr(tokenizer, "add_bos", True))))
        else:
            raise ValueError(f"{where}: expected 'messages', 'prompt' or 'tokens'")
        if not out[-1][1]:
            raise ValueError(f"{where}: the prompt is empty")
    if not out:
        raise ValueError(f"no prompts in {'stdin' if path == '-' else path}")
    return out


def run_generate(cfg: Config, tokenizer, *, input_path: str, output_path: str,
                 role_name: str | None, batch_size: int, written: Written | None = None
                 ) -> int:
    from megarlhf.engine.checkpoint import policy_role, read_meta, resolve_checkpoint
    from megarlhf.roles.spec import single_role_spec
    from megarlhf.roles.build import build_role
    from megarlhf.parallel.launch import init_distributed, read_dist_env
    from megarlhf.rollout.sampling import gather_generations
    from megarlhf.inference.generate import Generation, SamplingParams, generate
    from megarlhf.inference.reshard import Resharder, build_inference_model, inference_layout

    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size}: must be >= 1")
    if not cfg.checkpoint.load:
        raise ConfigError("generate needs a checkpoint: set checkpoint.load (a run's "
                          "checkpoints folder, one checkpoint, or a converted HF model)")
    meta = read_meta(resolve_checkpoint(cfg.checkpoint.load))
    role = policy_role(meta, role_name, cfg.checkpoint.load)
    if meta["roles"][role].get("kind", "lm") != "lm":
        raise ConfigError(f"role '{role}' of {cfg.checkpoint.load} is a value model; "
                          "generate samples from a language model")
    world = read_dist_env().world_size
    spec = single_role_spec(cfg, name=role, kind="lm", world_size=world, trained=False,
                            checkpoint_role=role, written=written)
    prompts = read_prompts(input_path, tokenizer)
    longest = max(len(ids) for _, ids in prompts) + cfg.rollout.max_new_tokens
    if longest > spec.model.max_position_embeddings:
        raise ConfigError(f"the longest prompt plus rollout.max_new_tokens is {longest} "
                          f"tokens, beyond the model's {spec.model.max_position_embeddings}")
    init_distributed(cfg)
    built = build_role(spec, seed=cfg.run.seed)
    inf = inference_layout(cfg.rollout.tensor_parallel_size, spec.model)
    model = build_inference_model(spec, inf)
    Resharder(built.chunks, model)()
    r = cfg.rollout
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                            top_k=r.top_k, top_p=r.top_p, greedy=r.greedy,
                            stop_token_ids=(*r.stop_token_ids, *tokenizer.end_ids),
                            stop_at_eos=r.stop_at_eos)
    _log(f"[generate] {spec.describe()}; rollout TP={inf.tp} x {inf.dp} "
           f"replica(s); {len(prompts)} prompts")
    rows = []
    bar = progress(len(prompts), 0, "generate", cfg.logging.progress_bar)
    for start in range(0, len(prompts), batch_size):
        batch = [ids for _, ids in prompts[start:start + batch_size]]
        mine = list(inf.run_share(len(batch)))
        if mine:  # one seed per prompt: samples do not depend on the layout
            gen = generate(model, [batch[i] for i in mine], params, eos_id=tokenizer.eos_id,
                           pad_id=tokenizer.pad_id, true_vocab=spec.model.vocab_size,
                           row_seeds=[derive_seed("row", cfg.run.seed, start + i)
                                      for i in mine])
        else:  # more replicas than prompts left
            gen = Generation(*(torch.zeros(0, 0, dtype=torch.long) for _ in range(6)))
        gen = gather_generations(gen, batch, inf, tokenizer.pad_id)
        for b in range(len(batch)):
            n = int(gen.fed_mask_BT[b].sum())
            ids = gen.response_tokens_BT[b, :n].tolist()
            finished = bool(gen.finished_B[b])
            text_ids = ids[:-1] if finished and ids else ids
            rows.append({"prompt": prompts[start + b][0], "response": tokenizer.decode(text_ids),
                         "response_tokens": ids, "finished": finished,
                         "logprob": float(gen.logprobs_BT[b, :n].sum())})
        bar.update(len(batch))
    bar.close()
    if dist.get_rank() == 0:
        stream = sys.stdout if output_path == "-" else open(output_path, "w")
        for row in rows:
            stream.write(json.dumps(row) + "\n")
        if output_path != "-":
            stream.close()
            _log(f"[generate] wrote {len(rows)} rows to {output_path}")
        else:
            stream.flush()
    return 0
