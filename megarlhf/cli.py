"""megarlhf: RLHF on megatron-core - supervised fine-tuning, a reward model, then PPO (or
GRPO, RLOO, REINFORCE++) with every role at its own tensor/pipeline layout.

The pipeline, on the synthetic task that `bash scripts/demo.sh` writes (runs/demo/task):

  megarlhf sft configs/sft_tiny.yaml
  megarlhf rm  configs/rm_tiny.yaml
  megarlhf ppo configs/demo/ppo.yaml ppo.sft_checkpoint=runs/sft-tiny/checkpoints \\
      ppo.reward_checkpoint=runs/rm-tiny/checkpoints
  megarlhf dpo configs/dpo_tiny.yaml checkpoint.load=runs/sft-tiny/checkpoints   # no RM
  torchrun --nproc-per-node 2 -m megarlhf.cli ppo configs/demo/ppo.yaml \\
      parallel.tensor_model_parallel_size=2

Before a big run, `megarlhf plan CONFIG --gpu-memory 80GiB` predicts every GPU's memory in
each PPO phase and says whether it fits.

Every setting is a field of one config tree: a YAML file plus key.sub=value overrides
(`megarlhf config show FILE [overrides] --docs` prints every field, its value and its
meaning). `megarlhf <command> --help` explains each command."""

from __future__ import annotations

import argparse
import os
import sys

from megarlhf import quiet_known_warnings, speedups
from megarlhf.config import Config, ConfigError, dump_config, read_config
from megarlhf.parallel.rank import launcher_rank


def _resolve(args) -> Config:
    """Config file + overrides, with the vocabulary taken from the tokenizer when unset
    (``args.written``: what they wrote; ``args.tokenizer``: the tokenizer or None). Each
    stage resolves its roles (model from checkpoint, layout) and validates them against
    the launcher's world size before any process group exists."""
    cfg, args.written = read_config(args.config, args.overrides)
    tokenizer = None
    if cfg.tokenizer.path is not None:
        from megarlhf.data.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(cfg.tokenizer)
        if cfg.model.vocab_size is None:
            cfg = _with_vocab(cfg, tokenizer.vocab_size)
        elif cfg.model.vocab_size < tokenizer.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the "
                              f"tokenizer's vocabulary ({tokenizer.vocab_size}, "
                              f"{cfg.tokenizer.path}): tokenizer and model do not match")
    args.tokenizer = tokenizer
    return cfg


def _with_vocab(cfg: Config, vocab_size: int) -> Config:
    """``cfg`` with ``model.vocab_size`` resolved (a new config; none is changed)."""
    import dataclasses

    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


def cmd_config_show(args) -> int:
    if args.config is not None and "=" in args.config:  # no file, only overrides
        args.overrides, args.config = [args.config, *args.overrides], None
    cfg, written = read_config(args.config, args.overrides)
    print(dump_config(cfg, docs=args.docs), end="")
    if cfg.roles.actor.checkpoint:
        print(_resolved_roles(cfg, written, args.world_size), end="")
    return 0


def _resolved_roles(cfg: Config, written, world_size: int) -> str:
    """The PPO roles as a run would build them: checkpoint, model, layout, optimizer."""
    import dataclasses

    import yaml

    from megarlhf.config import check_placement
    from megarlhf.roles.spec import ppo_role_specs

    job, world_size = world_size, check_placement(cfg, world_size)
    if cfg.tokenizer.path is not None and cfg.model.vocab_size is None:
        from megarlhf.data.tokenizer import load_tokenizer
        cfg = _with_vocab(cfg, load_tokenizer(cfg.tokenizer).vocab_size)
    view = {}
    for name, spec in ppo_role_specs(cfg, world_size, written=written).items():
        entry = {"checkpoint": spec.checkpoint, "checkpoint_role": spec.checkpoint_role,
                 "kind": spec.kind + (" (trunk only: new scalar head)" if spec.trunk_only
                                      else ""),
                 "model": dataclasses.asdict(spec.model),
                 "parallel": {"tensor_model_parallel_size": spec.layout.tp,
                              "pipeline_model_parallel_size": spec.layout.pp,
                              "virtual_pipeline_model_parallel_size": spec.layout.vpp,
                              "data_parallel_size": spec.layout.dp(world_size)}}
        if spec.optimizer is not None:
            entry["optimizer"] = dataclasses.asdict(spec.optimizer)
        view[name] = entry
    where = f"world size {world_size}" if job == world_size else \
        (f"world size {world_size}: the training processes of a job of {job}, whose last "
         f"{job - world_size} only sample (rollout.placement.mode=split)")
    return (f"# resolved roles at {where} (models from their checkpoints, "
            "layouts defaulting to the actor's):\n"
            + yaml.safe_dump({"resolved_roles": view}, sort_keys=False))


def cmd_score(args) -> int:
    from megarlhf.stages.score import run_score

    cfg = _resolve(args)
    if cfg.model.vocab_size is None:
        raise ConfigError("model.vocab_size is unset and no tokenizer.path is configured")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ConfigError(f"--max-tokens={args.max_tokens} must be >= 1")
    run_score(cfg, args.input, args.output, role=args.role,
              micro_batch_size=args.micro_batch_size, max_tokens=args.max_tokens,
              temperature=args.temperature,
              tokenizer=args.tokenizer, ckpt_role=args.ckpt_role, written=args.written)
    return 0


def _needs_tokenizer(cfg: Config, args) -> None:
    if args.tokenizer is None:
        raise ConfigError("tokenizer.path is required for this stage")
    if cfg.data.train_path is None:
        raise ConfigError("data.train_path is required for this stage")


def _stage(module: str, function: str):
    """The command of a training stage: resolve the config (tokenizer and data required),
    then ``module.function(cfg, tokenizer, written)``."""

    def command(args) -> int:
        import importlib

        cfg = _resolve(args)
        _needs_tokenizer(cfg, args)
        getattr(importlib.import_module(module), function)(cfg, args.tokenizer, args.written)
        return 0

    return command


cmd_sft = _stage("megarlhf.stages.sft", "run_sft")
cmd_rm = _stage("megarlhf.stages.rm", "run_rm")
cmd_ppo = _stage("megarlhf.stages.ppo", "run_ppo")
cmd_dpo = _stage("megarlhf.stages.offline", "run_dpo")
cmd_distill = _stage("megarlhf.stages.offline", "run_distill")


def cmd_cache_build(args) -> int:
    from megarlhf.stages.offline import run_cache_build

    cfg = _resolve(args)
    _needs_tokenizer(cfg, args)
    path = run_cache_build(cfg, args.tokenizer, args.stage, args.written)
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"cache ready: {path}")
    return 0


def cmd_plot(args) -> int:
    from megarlhf.stages.plot import plot_run

    for path in plot_run(args.run_dir):
        print(f"wrote {path}")
    return 0


def cmd_plan(args) -> int:
    from megarlhf.memory.estimates import GIB
    from megarlhf.memory.plan import plan_ppo
    from megarlhf.memory.report import explain, format_plan, parse_bytes

    cfg = _resolve(args)
    gpus = args.gpus_per_node or cfg.launch.gpus_per_node or cfg.launch.tasks_per_node
    nodes = args.nodes or cfg.launch.nodes
    world = nodes * gpus
    capacity = parse_bytes(args.gpu_memory) if args.gpu_memory else (
        cfg.launch.gpu_memory_gib * GIB if cfg.launch.gpu_memory_gib else None)
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom {args.headroom}: must be in [0, 1)")
    print(f"megarlhf plan: PPO of {args.config} on {nodes} node(s) x {gpus} GPU(s) = "
          f"{world} processes")
    if capacity is None:
        if args.search:
            raise ConfigError("megarlhf plan --search needs the GPUs' memory: --gpu-memory "
                              "(e.g. 80GiB) or launch.gpu_memory_gib")
        print(format_plan(plan_ppo(cfg, world, written=args.written), None, args.headroom))
        return 0
    ok, text = explain(cfg, world, capacity, gpus, args.headroom, written=args.written,
                       search=args.search)
    print(text)
    return 0 if ok else 1


def cmd_generate(args) -> int:
    from megarlhf.stages.sample import run_generate

    cfg = _resolve(args)
    if args.tokenizer is None:
        raise ConfigError("generate needs tokenizer.path (the model's tokenizer)")
    return run_generate(cfg, args.tokenizer, input_path=args.input, output_path=args.output,
                        role_name=args.role, batch_size=args.batch_size, written=args.written)


def cmd_export(args) -> int:
    from megarlhf.engine.streaming import return_freed_memory
    from megarlhf.stages.common import run_dir
    from megarlhf.stages.export import export_checkpoint

    cfg = _resolve(args)
    ckpt = args.ckpt or os.path.join(run_dir(cfg), "checkpoints")
    if not os.path.exists(ckpt):
        raise FileNotFoundError(f"no checkpoint at {ckpt} (the run's checkpoints folder): "
                                "pass --ckpt, or the config and overrides the run used")
    return_freed_memory()  # a layer at a time: what each frees goes back to the system
    info = export_checkpoint(cfg, args.out, ckpt, args.role, args.model_type,
                             args.shard_layers, tokenizer=args.tokenizer, written=args.written,
                             peft=args.peft)
    for key, value in info.items():
        print(f"{key}: {value}")
    return 0


def cmd_launch(args) -> int:
    from megarlhf.sbatch import render_sbatch, submit

    if not args.slurm:
        raise ConfigError("only --slurm launching is implemented; use torchrun locally")
    cfg, written = read_config(args.config, args.overrides)
    script = render_sbatch(cfg, args.stage, args.config, list(args.overrides), written)
    if args.dry_run:
        print(script, end="")
        return 0
    job = submit(script, cfg, args.stage)
    print(f"submitted job {job}; log: {cfg.launch.log_dir}/megarlhf-{args.stage}-"
          f"{cfg.run.name}-{job}.out")
    return 0


STAGES = [
    ("sft", cmd_sft, "supervised fine-tuning: next-token loss on the response tokens",
     "example:\n  megarlhf sft configs/sft_tiny.yaml data.train_path=runs/demo/task/sft.jsonl "
     "train.num_epochs=2\n(a Hugging Face model on chat data: docs/your-own-model.md)\n\ndata: JSONL/Parquet rows with 'prompt' and 'response' "
     "(data.prompt_key, data.response_key), or chat 'messages' (data.messages_key; loss "
     "on every assistant turn, rendered with the tokenizer's chat template)."),
    ("rm", cmd_rm, "reward model: pairwise Bradley-Terry loss, then score normalisation",
     "example:\n  megarlhf rm configs/rm_tiny.yaml data.train_path=runs/demo/task/prefs.jsonl"
     "\n\ndata: rows with 'prompt', 'chosen', 'rejected' strings, or "
     "chosen/rejected conversations sharing their first turns (HH-RLHF) with an optional "
     "'prompt' (UltraFeedback-binarized)."),
    ("ppo", cmd_ppo, "PPO (GRPO, RLOO, REINFORCE++) with actor, critic, reference and "
     "reward roles, each at its own layout",
     "example:\n  megarlhf ppo configs/demo/ppo.yaml ppo.sft_checkpoint=runs/demo/sft-tiny/"
     "checkpoints ppo.reward_checkpoint=runs/demo/rm-tiny/checkpoints\n\nGRPO: ppo.advantage_estimator=grpo "
     "ppo.group_size=8 ppo.kl.loss_coef=0.04 (GRPO keeps the KL out of the reward, so "
     "ppo.kl.init_coef and an adaptive controller are refused there).\n\nMemory: "
     "roles.actor.offload="
     "optimizer|optimizer+grads|all (and roles.critic.offload) moves the trained roles' state "
     "off the GPU during the rollout; memory/<phase>/<role>/<part> metrics and an end-of-run "
     "table report what each phase held; `megarlhf plan CONFIG` predicts it.\n\ndata: rows with 'prompt' text or chat 'messages' ending with the user's turn. "
     "`megarlhf config show FILE "
     "--world-size N` prints the roles as this run would build them."),
    ("dpo", cmd_dpo, "DPO (sigmoid, cDPO label smoothing, or IPO) on preference pairs, "
     "reference log-probs from the cache",
     "example:\n  megarlhf dpo configs/dpo_tiny.yaml checkpoint.load=runs/demo/sft-tiny/"
     "checkpoints data.train_path=runs/demo/task/prefs.jsonl dpo.beta=0.1\n\ndata: rows with 'prompt', 'chosen', "
     "'rejected'. The reference (dpo.reference_checkpoint, default the policy's "
     "checkpoint.load) scores every pair once into cache.path (default RUN_DIR/cache/"
     "reference) and is released before the policy is built; reruns reuse the cache, "
     "a stale one (other checkpoint or data) is rebuilt (cache.on_stale=error refuses). "
     "Metrics: train/loss, train/rewards/{chosen,rejected,margin,accuracy} and eval/*. "
     "Pairs may also be conversations (as for `megarlhf rm`)."),
    ("distill", cmd_distill, "distillation: a student learns a teacher's cached top-k "
     "next-token log-probs on the response tokens",
     "example:\n  megarlhf distill configs/sft_tiny.yaml distill.teacher_checkpoint="
     "runs/demo/sft-tiny/checkpoints data.train_path=runs/demo/task/sft.jsonl "
     "distill.top_k=16\n\ndata: rows "
     "with 'prompt' and 'response'. distill.divergence=forward is KL(teacher || student) "
     "over the teacher's top-k tokens plus one bucket for the rest; reverse is "
     "KL(student || teacher) on the same buckets. The teacher runs once, at "
     "roles.teacher.parallel, into the cache."),
]

STAGE_EPILOG = """

Overrides: any config field as key.sub=value after the config (lists as [a,b], null
for None); `megarlhf config show CONFIG [overrides] --docs` prints every field with its
meaning and valid range.

Outputs go to {run.output_dir}/{run.name}: metrics.jsonl, TensorBoard, curves
(`megarlhf plot`), checkpoints/. Rerunning the same command resumes from the latest
checkpoint (at any layout); checkpoint.resume=false starts over.

Signals: SIGUSR1 or SIGTERM (Slurm preemption) and Ctrl-C make the run checkpoint at its
next safe point and exit 0 (Slurm requeues it); a second Ctrl-C aborts at once. Under a
local torchrun, signal the workers (pkill -USR1 -f megarlhf.cli), not torchrun itself.
Bad settings and mismatched checkpoints are refused before any work (exit 2)."""


def _config_args(parser, config_help: str,
                 overrides_help: str = "key.sub=value overrides") -> None:
    parser.add_argument("config", help=config_help)
    parser.add_argument("overrides", nargs="*", help=overrides_help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarlhf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    config = sub.add_parser("config", help="inspect configs")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved config")
    show.add_argument("config", nargs="?", help="YAML config (omit for defaults)")
    show.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    show.add_argument("--docs", action="store_true",
                      help="each field's meaning and valid range as a comment above it")
    show.add_argument("--world-size", type=int, default=1,
                      help="processes to resolve the PPO roles' layouts for (default 1)")
    show.set_defaults(func=cmd_config_show)

    score = sub.add_parser("score", help="per-token log-probs / values of token sequences")
    score.add_argument("--config", help="YAML config")
    score.add_argument("--input", required=True, help="JSONL with 'tokens' or 'text' per row")
    score.add_argument("--output", required=True, help="JSONL to write")
    score.add_argument("--role", choices=["lm", "value"], default="lm",
                       help="lm: log-probs (policy/reference); value: critic/RM values")
    score.add_argument("--micro-batch-size", type=int, default=4,
                       help="rows per padded forward pass (default 4)")
    score.add_argument("--max-tokens", type=int, default=None,
                       help="pack the sequences instead: each forward pass takes whole "
                            "sequences back to back, at most this many tokens (at least the "
                            "longest sequence; a row under 65 tokens is topped up to 65)")
    score.add_argument("--temperature", type=float, default=1.0)
    score.add_argument("--ckpt-role", default=None,
                       help="role to read from checkpoint.load (default: its only role)")
    score.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    score.set_defaults(func=cmd_score)

    for name, func, text, example in STAGES:
        stage = sub.add_parser(name, help=text, description=f"{text}.\n\n{example}"
                               + STAGE_EPILOG,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        stage.add_argument("config", help="YAML config (configs/ has examples)")
        stage.add_argument("overrides", nargs="*",
                           help="key.sub=value overrides of any config field, e.g. "
                                "optimizer.lr=1e-5 roles.critic.parallel."
                                "pipeline_model_parallel_size=2")
        stage.set_defaults(func=func)
    cache = sub.add_parser("cache", help="the frozen-model cache of dpo / distill")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    build = cache_sub.add_parser(
        "build", help="build (or verify) the cache a dpo/distill config reads",
        description="Score the config's data with its frozen model (DPO reference or "
        "distillation teacher) at that model's layout and write the cache atomically, "
        "so the training run never builds the frozen model. Runs under torchrun like the "
        "stages.\n\nexample:\n  megarlhf cache build dpo configs/dpo_tiny.yaml "
        "checkpoint.load=runs/demo/sft-tiny/checkpoints "
        "data.train_path=runs/demo/task/prefs.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    build.add_argument("stage", choices=["dpo", "distill"])
    _config_args(build, "the stage's YAML config")
    build.set_defaults(func=cmd_cache_build)
    plan = sub.add_parser(
        "plan", help="predict per-GPU memory of every PPO role and phase; does it fit?",
        description="Predict, before anything is built, the bytes every rank holds in each "
        "PPO phase (rollout, experience, train, save) for every role: parameters, "
        "gradients, optimizer state and the KV cache exactly (megatron's padded buffers "
        "and distributed-optimizer shards included), activations and transient logits as "
        "estimates. Says whether the run fits the GPUs, names the largest consumer, and "
        "when it does not fit (or with --search) lists the cheapest uniform layouts, "
        "recomputation, offload levels and micro-batches that would. "
        "Roles whose checkpoints do not exist yet are sized from the config's model "
        "(model.* and roles.<name>.model.*). Runs in one process; no GPU needed. Exit "
        "status 1 when it does not fit.\n\nexample (an 8B actor, critic and reference and "
        "a 1B reward model on 2 nodes of 8 x 80 GiB):\n  megarlhf plan configs/plan_8b.yaml "
        "--gpu-memory 80GiB --gpus-per-node 8 --nodes 2\n\nThe run itself logs the same "
        "quantities measured (memory/<phase>/<role>/<part>, MiB) and prints a table at "
        "the end; `megarlhf launch` refuses a config that does not fit "
        "launch.gpu_memory_gib.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _config_args(plan, "a PPO YAML config")
    plan.add_argument("--gpu-memory", help="memory of one GPU, e.g. 80GiB or 141GB "
                      "(default launch.gpu_memory_gib; none: report only)")
    plan.add_argument("--gpus-per-node", type=int, default=None,
                      help="processes per node (default launch.gpus_per_node)")
    plan.add_argument("--nodes", type=int, default=None, help="nodes (default launch.nodes)")
    plan.add_argument("--headroom", type=float, default=0.1,
                      help="fraction of GPU memory kept for the CUDA context, NCCL and "
                      "fragmentation (default 0.1)")
    plan.add_argument("--search", action="store_true",
                      help="list the cheapest uniform layouts that fit even when the "
                      "config does: TP x PP (sequence parallelism at TP > 1), the rollout's "
                      "TP, full recomputation, the trained roles' offload and the "
                      "micro-batch (needs --gpu-memory or launch.gpu_memory_gib)")
    plan.set_defaults(func=cmd_plan)
    gen = sub.add_parser(
        "generate", help="sample from a checkpoint (any layout) with the rollout settings",
        description="Sample responses from checkpoint.load's policy (or --role) with the "
        "rollout settings (rollout.temperature, top_k, top_p, greedy, max_new_tokens, "
        "stop_token_ids). The model is built at parallel.* (TP/PP) and resharded into "
        "rollout.tensor_parallel_size; under torchrun the replicas share the prompts and "
        "rank 0 writes the rows in input order. Each prompt has its own seed (run.seed), so "
        "the samples do not depend on the layout.\n\ninput: JSONL rows with 'messages' "
        "(chat template + generation prompt), 'prompt' (text) or 'tokens'; a line that is "
        "not JSON is a text prompt. output: JSONL rows with prompt, response, "
        "response_tokens, finished, logprob.\n\nexamples:\n  echo 'words: red cat' | "
        "megarlhf generate configs/sft_tiny.yaml checkpoint.load=runs/demo/sft-tiny/"
        "checkpoints -i - -o -\n  torchrun --nproc-per-node 2 -m megarlhf.cli generate "
        "configs/sft_tiny.yaml checkpoint.load=runs/demo/sft-tiny/checkpoints -i "
        "runs/demo/task/eval_prompts.jsonl -o runs/demo/samples.jsonl "
        "parallel.tensor_model_parallel_size=2 rollout.greedy=true",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _config_args(gen, "YAML config (model, tokenizer, checkpoint.load)")
    gen.add_argument("-i", "--input", required=True, help="prompts file, or - for stdin")
    gen.add_argument("-o", "--output", default="-", help="JSONL to write, or - for stdout")
    gen.add_argument("--role", help="checkpoint role (default: actor, policy or its only one)")
    gen.add_argument("--batch-size", type=int, default=16, help="prompts per batch")
    gen.set_defaults(func=cmd_generate)
    export = sub.add_parser(
        "export", help="a run's trained policy (or EMA, critic, reward model) as a Hugging "
        "Face directory", description="Write the latest checkpoint of a run (the config and "
        "overrides it ran with) as a directory transformers loads with from_pretrained: "
        "config.json, safetensors, the run's tokenizer files with its chat template, and "
        "generation_config.json with the run's stop tokens and sampling settings. The "
        "checkpoint may be at any layout; it is read in one process, a layer at a time.\n\nexamples:\n  megarlhf export "
        "configs/demo/ppo.yaml run.output_dir=runs/demo --out runs/demo/ppo-tiny/hf   # the "
        "actor\n  megarlhf export configs/sft_tiny.yaml --out runs/demo/sft-tiny/hf --ckpt "
        "runs/demo/sft-tiny/checkpoints\n(--role ema: the EMA actor of a run with "
        "ppo.ema_decay)\n\nThen: transformers.AutoModelForCausalLM.from_pretrained(OUT).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _config_args(export, "the run's YAML config", "key.sub=value overrides the run used")
    export.add_argument("--out", required=True, help="Hugging Face directory to write")
    export.add_argument("--ckpt", help="checkpoint folder or one checkpoint (default: the "
                        "run's checkpoints, latest)")
    export.add_argument("--role", help="role in the checkpoint: actor (ppo), policy (sft, "
                        "dpo), ema, critic, reward (default: actor or policy)")
    export.add_argument("--model-type", choices=["llama", "mistral", "qwen2", "qwen3",
                                                 "qwen3_moe", "mixtral", "gpt2"],
                        help="HF architecture (default: from the checkpoint)")
    export.add_argument("--shard-layers", type=int, default=0,
                        help="layers per safetensors shard (0: one file)")
    export.add_argument("--peft", action="store_true",
                        help="a LoRA model's adapters alone, as a PEFT adapter folder "
                        "(adapter_config.json, adapter_model.safetensors) that "
                        "peft.PeftModel.from_pretrained puts on the base model; without "
                        "it the adapters are merged into the exported weights")
    export.set_defaults(func=cmd_export)
    launch = sub.add_parser("launch", help="render and submit an sbatch script for a stage")
    launch.add_argument("stage", choices=["sft", "rm", "ppo", "dpo", "distill"])
    _config_args(launch, "YAML config")
    launch.add_argument("--slurm", action="store_true", help="submit to Slurm with sbatch")
    launch.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    launch.set_defaults(func=cmd_launch)
    plot = sub.add_parser("plot", help="PNG curves from a run's metrics.jsonl")
    plot.add_argument("run_dir")
    plot.set_defaults(func=cmd_plot)
    return parser


def _note_missing_gpu_extras() -> None:
    """On a GPU without TransformerEngine, one line instead of megatron's import warnings
    (which are silenced above): what runs instead and how to get the fast path."""
    import torch

    if not torch.cuda.is_available() or launcher_rank() != 0:
        return
    from megarlhf.models.spec import transformer_engine_available

    if not transformer_engine_available():
        print("megarlhf: note: TransformerEngine is not installed; megatron-core's local "
              "layers run (no fp8, unfused kernels). pip install 'megarlhf[fp8]' for the "
              "TransformerEngine path.", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    quiet_known_warnings()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    training = args.command in ("sft", "rm", "ppo", "dpo", "distill")
    if training:
        # Before anything slow: a signal during start-up is honoured at the first safe point.
        from megarlhf.parallel.signals import install_handlers
        install_handlers()
    try:  # the start-up speed-ups must be in before megatron is imported
        speedups.install()
    except ValueError as err:
        print(f"megarlhf: error: {err}", file=sys.stderr)
        return 2
    if training:
        _note_missing_gpu_extras()
        if launcher_rank() == 0:
            print(f"[megarlhf] {speedups.describe()}", flush=True)
    # key=value overrides may come before or after options.
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as err:
        if os.environ.get("MEGARLHF_TRACEBACK"):  # the full traceback, for bug reports
            raise
        from megarlhf.parallel import watchdog
        stalled = watchdog.explain(err)  # a collective timed out: say who went quiet
        if stalled:
            print(stalled, file=sys.stderr, flush=True)
            return watchdog.EXIT_CODE
        print(f"megarlhf: error: {err}", file=sys.stderr)
        return 2
    finally:
        if args.command not in ("config", "plot", "launch"):  # (cache build: a group too)
            from megarlhf.parallel.launch import shutdown
            shutdown()


if __name__ == "__main__":
    sys.exit(main())
