"""A PyTorch DDP script as a user writes one against fsdprun's Python module.

Trains a seeded MLP with DDP (Gloo, CPU) for --steps steps; the batch of step s on rank r comes
from seed 1000*s + r alone, so a run resumed from any step ends with the parameters of one never
stopped. Each step: report_step, mark_progress, snapshot of the model and the optimizer (SGD with
momentum: its state matters). On a start it restores what the agents hold.
Faults, on the first attempt only: --kill_rank R --kill_step S SIGKILLs rank R after step S;
--stall_rank R --stall_step S --stall_kind loop|read makes rank R spin in stuck_in_a_loop() or
block in stuck_in_a_read() just before step S's backward. --slow_rank R --slow_ms MS: rank R's
every forward takes MS longer (a straggler).
--hidden N: the model's width (a state past a socket's send buffer, 1536: 19 MB).
--metrics_file F: rank 0 appends {"type": "train", "step", "unix_time"} per step and a "resume" line.
Rank 0 prints one JSON line at the end: {"steps", "resumed_step", "resumed_from", "attempt",
"params_sha256", "step_ms_median" (this attempt's steps, snapshot included), "fsdprun": whether the
module was active}.
"""
import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdprun


def stuck_in_a_loop() -> None:
    spins = 0
    while True:
        spins += 1


def stuck_in_a_read() -> None:
    read_end, _ = os.pipe()
    os.read(read_end, 1)


def metrics(args, rank: int, line: dict) -> None:
    """Rank 0's metrics line (the node tests wait on them), appended in one write."""
    if args.metrics_file and rank == 0:
        line["unix_time"] = time.time()
        with open(args.metrics_file, "a") as f:
            f.write(json.dumps(line) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill_rank", type=int, default=-1)
    parser.add_argument("--kill_step", type=int, default=-1)
    parser.add_argument("--stall_rank", type=int, default=-1)
    parser.add_argument("--stall_step", type=int, default=-1)
    parser.add_argument("--stall_kind", default="loop")
    parser.add_argument("--no_snapshot", action="store_true")
    parser.add_argument("--background_snapshot", action="store_true", help="snapshot(background=True)")
    parser.add_argument("--metrics_file", default="")
    parser.add_argument("--step_sleep", type=float, default=0.0, help="seconds of sleep per step")
    parser.add_argument("--replicated", action="store_true", help="restore(replicated=True)")
    parser.add_argument("--slow_rank", type=int, default=-1, help="this rank's forward takes --slow_ms longer")
    parser.add_argument("--slow_ms", type=float, default=0.0)
    parser.add_argument("--hidden", type=int, default=64, help="the middle layer's width (1536: a 19 MB state)")
    args = parser.parse_args()
    standalone = "RANK" not in os.environ
    if standalone:  # python3 ddp_snapshot.py: one process, a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(20, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                              nn.Linear(args.hidden, 4)))
    fsdprun.record_ddp(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # DDP lays its buckets out again after the first backward of a process (in the order the
    # gradients came), and a bucket's layout decides the order Gloo adds the ranks' values in: a
    # backward before the loop gives the first step after a restore the layout every other step
    # has, so a resumed run can end bit-identical to one never stopped.
    model(torch.zeros(1, 20)).sum().backward()
    optimizer.zero_grad()

    step, resumed_from, resumed_step = 0, None, None
    restored = fsdprun.restore(replicated=args.replicated)
    if restored is not None:
        step, state = restored
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        resumed_step, resumed_from = step, fsdprun.restored_from()
        metrics(args, rank, {"type": "resume", "step": step, "source": resumed_from})
    step_ms = []
    while step < args.steps:
        began = time.perf_counter()
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 20, generator=g)
        y = torch.randint(0, 4, (16,), generator=g)
        optimizer.zero_grad()
        if args.step_sleep > 0:
            with fsdprun.data_wait():  # as a slow data loader would
                time.sleep(args.step_sleep)
        loss = nn.functional.cross_entropy(model(x), y)
        if rank == args.slow_rank:
            time.sleep(args.slow_ms / 1000)  # a slower device: its compute, the others wait in DDP
        if attempt == 0 and rank == args.stall_rank and step + 1 == args.stall_step:
            stuck_in_a_loop() if args.stall_kind == "loop" else stuck_in_a_read()
        loss.backward()
        optimizer.step()
        step += 1
        fsdprun.report_step(samples=len(x), loss=loss.item())
        fsdprun.mark_progress(step)
        metrics(args, rank, {"type": "train", "step": step})
        if not args.no_snapshot:
            fsdprun.snapshot(step, {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                             background=args.background_snapshot)
        step_ms.append(1000 * (time.perf_counter() - began))
        if attempt == 0 and rank == args.kill_rank and step == args.kill_step:
            fsdprun.wait()  # the peer copy of this step is out
            os.kill(os.getpid(), signal.SIGKILL)
    digest = hashlib.sha256()
    for p in model.module.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    if rank == 0:
        print(json.dumps({"steps": step, "resumed_step": resumed_step, "resumed_from": resumed_from,
                          "attempt": attempt, "params_sha256": digest.hexdigest(),
                          "step_ms_median": sorted(step_ms)[len(step_ms) // 2] if step_ms else None,
                          "fsdprun": fsdprun.enabled()}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
