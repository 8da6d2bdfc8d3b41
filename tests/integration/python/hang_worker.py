"""A plain PyTorch program (no libfsdp) whose rank 1 never reaches the all_reduce.

Rank 1 blocks reading a pipe nobody writes; the others wait in Gloo's all_reduce until the
process group's timeout (--timeout seconds) makes them fail. fsdprun's failure report then
shows what rank 1 was doing: its state and its stacks.
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist


def wait_for_nothing() -> None:
    read_end, _ = os.pipe()
    os.read(read_end, 1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=12)
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method="env://",
                            timeout=datetime.timedelta(seconds=args.timeout))
    if dist.get_rank() == 1:
        wait_for_nothing()
    dist.all_reduce(torch.ones(3))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
