"""megarlhf: RLHF (PPO and relatives) on megatron-core."""

__version__ = "0.1.0"


def quiet_known_warnings() -> None:
    """Silence third-party warnings a user cannot act on: megatron-core announces its torch
    fallbacks for Apex/TransformerEngine on every import (expected on CPU; on a GPU the CLI
    prints one line instead), and torch/transformers deprecation notices."""
    import warnings

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex).*")
    warnings.filterwarnings("ignore", message=".*cuda_graph_scope.*")
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore",
                            message=".*The .grad attribute of a Tensor that is not a leaf.*")
