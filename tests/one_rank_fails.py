"""Test-only: `python -m torch.distributed.run --nproc_per_node=2 ... tests/one_rank_fails.py ERROR`: rank 1 raises
ERROR (a builtin exception's name: ValueError, bad input; RuntimeError, a bug) while rank 0 waits for it in a
collective (test_running.py's test_an_error_on_one_rank_ends_the_job_at_once)."""

import builtins
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # the project's folder first

ERROR = getattr(builtins, sys.argv[1])


def train(args):
    rank = common.setup_distributed()[0]
    if rank == 1:
        raise ERROR("rank 1 alone cannot read its input")
    return common.broadcast_object("rank 0 waits here for rank 1")


if __name__ == "__main__":
    common.run_main(train, common.RunArgs, [])
