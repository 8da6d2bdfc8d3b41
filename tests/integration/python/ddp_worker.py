"""A plain PyTorch program, unchanged for fsdprun: env:// init, Gloo, one all_reduce.

Prints one line per rank; exits non-zero on a wrong result.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pid_dir", help="write PID_DIR/<rank>.pid first")
    parser.add_argument("--hang_if_world", nargs=2, type=float, metavar=("N", "SECONDS"),
                        help="after init, sleep SECONDS while WORLD_SIZE is N")
    args = parser.parse_args()
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, os.environ["RANK"] + ".pid"), "w") as f:
            f.write(f"{os.getpid()}\n")
    dist.init_process_group("gloo", init_method="env://")
    if args.hang_if_world and dist.get_world_size() == int(args.hang_if_world[0]):
        time.sleep(args.hang_if_world[1])
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    if t.tolist() != [expected] * 3:
        print(f"rank {rank}: all_reduce gave {t.tolist()}, expected {expected}", file=sys.stderr)
        return 3
    dist.barrier()
    print(f"rank {rank} of {world}: all_reduce ok "
          f"(MASTER {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}, "
          f"agent store {os.environ['TORCHELASTIC_USE_AGENT_STORE']}, "
          f"restart {os.environ['TORCHELASTIC_RESTART_COUNT']})", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
