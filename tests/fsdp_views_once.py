"""Test-only: HFPolicy.completion_logprobs under FSDP2 on each rank, run by test_hf_policy.py's
test_views_once_under_fsdp_give_the_per_row_gradients as

    python -m torch.distributed.run --nproc_per_node=2 --standalone tests/fsdp_views_once.py MODEL_DIR OUT

Rank r scores G rows of each of its two studies (one view and two, in the rank's order: each study's views through the
vision tower once, their features repeated to its G rows) with the model shard()ed over the ranks, weights each
log-prob, and backward averages the gradients over the ranks. Rank 0 writes OUT/grads.pt: every parameter's full
gradient, by name."""

import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # the project's folder first

G = 4
PROMPT = "Describe the chest X-ray."
REPORT = "the heart is normal in size . small left pleural effusion . no pneumothorax ."


def studies(rank: int) -> list:
    """Rank r's two studies of grey random views, the same on every run: 1 view then 2 on rank 0, 2 then 1 on rank 1."""
    rng = np.random.default_rng(rank)
    views = (1, 2) if rank == 0 else (2, 1)
    return [[Image.fromarray(rng.integers(0, 256, (64, 64), dtype=np.uint8)) for _ in range(v)] for v in views]


def rows(policy, rank: int):
    """Rank r's 2 x G completions, study by study: the report cut to 2 G lengths (ids and mask, right-padded)."""
    words = REPORT.split()
    return policy.encode_targets([" ".join(words[: 2 + rank + j]) for j in range(2 * G)])


def weights(logp):
    """A weight per log-prob: a loss whose gradient a slip in the rows' order would change."""
    return torch.linspace(0.5, 1.5, logp.numel()).view_as(logp)


def main(model_dir: str, out: str):
    torch.set_num_threads(1)
    rank, _, _ = common.setup_distributed()
    policy = common.HFPolicy(model_dir, device="cpu")
    common.shard(policy.model)
    prompts = policy.prompt_batch(studies(rank), PROMPT)
    ids, mask = rows(policy, rank)
    logp = policy.completion_logprobs(prompts, ids, mask)  # (2 G, T): each study's views once
    (logp * weights(logp)).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in policy.model.named_parameters()}  # every rank takes part
    if rank == 0:
        torch.save(grads, Path(out) / "grads.pt")
    common.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
