"""Context parallelism's pieces (``megarlhf.parallel.context``): the load-balanced split
of a sequence and causal attention over the CP group, against one process."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import WORKERS, torchrun
from megarlhf.parallel import context


def test_the_split_pairs_an_early_chunk_with_a_late_one_and_covers_the_sequence():
    """Megatron's load-balanced split: CP rank r keeps chunks r and 2 CP - 1 - r of 2 CP;
    the ranks' parts cover every position once; a length that does not split is named."""
    assert context.chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context.chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    parts = torch.cat([context.chunk_positions(24, 3, r) for r in range(3)])
    assert sorted(parts.tolist()) == list(range(24))
    stacked = torch.arange(24)[parts]  # the parts stacked rank after rank
    assert torch.equal(stacked[context._order(24, 3)], torch.arange(24))
    with pytest.raises(ValueError, match="10 positions does not split into 2 x CP = 4"):
        context.chunk_positions(10, 2, 0)


@pytest.mark.slow
def test_attention_over_two_cp_ranks_equals_one_process(tmp_path):
    """CP=2 over gloo, float64: the causal attention of each rank's queries over the
    gathered keys and values (a left-padded row included) and the gradients of the
    queries, keys and values - summed over the ranks whose queries read them - equal
    plain SDPA over the whole sequence. Catches a wrong chunk order, a mask of local
    instead of global positions, and key gradients not summed over the CP ranks."""
    torchrun(os.path.join(WORKERS, "cp_attention.py"), 2, str(tmp_path))
    out = torch.load(tmp_path / "cp_attention.pt", weights_only=True)
    for key in ("out", "q", "k", "v"):
        torch.testing.assert_close(out["cp"][key], out["reference"][key], rtol=1e-10,
                                   atol=1e-10, msg=key)
