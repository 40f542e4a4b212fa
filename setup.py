"""megarlhf: RLHF training (PPO and relatives) on NVIDIA megatron-core."""

from setuptools import find_packages, setup

# torch is not pinned here: GPU users bring their own build (NGC container). The CPU
# set-up path (scripts/setup_env.sh) pins torch==2.13.0, since an unpinned torch pulls
# a multi-GB CUDA build. NVIDIA apex is used by megatron-core when a cluster has it
# built from source; the PyPI package named "apex" is unrelated and never a dependency.
INSTALL_REQUIRES = [
    "torch>=2.4",
    "megatron-core==0.16.1",  # the CPU backend depends on its internals
    "einops",  # megatron.core.hyper_comm_grid
    "psutil",  # megatron.core.dist_checkpointing
    "numpy",
    "sentencepiece",
    "tokenizers",
    "jinja2",  # chat templates, rendered as transformers renders them (torch needs it too)
    "datasets",
    "safetensors",
    "pyyaml",
    "tqdm",
    "tensorboard",
    "matplotlib",
    "fastapi",  # the agents' OpenAI-compatible endpoint (rollout.agent), on uvicorn
    "uvicorn",
]

EXTRAS = {
    "fp8": ["transformer-engine[pytorch]"],
    # transformers, trl and peft are oracles; trl's GRPOTrainer (bench/async_grpo.py)
    # imports requests, which trl does not declare; openai is the agents' client
    "test": ["pytest", "pytest-timeout", "pytest-xdist", "transformers", "trl==1.12.0",
             "peft==0.21.2", "requests", "openai"],
    "wandb": ["wandb"],
}

setup(
    name="megarlhf",
    version="0.1.0",
    description="RLHF (PPO, GRPO, ...) for large language models on megatron-core",
    packages=find_packages(include=["megarlhf", "megarlhf.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["megarlhf = megarlhf.cli:main"]},
)
