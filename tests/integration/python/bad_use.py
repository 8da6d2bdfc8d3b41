"""fsdprun's Python module used wrongly, under fsdprun --nproc_per_node 1 --max_restarts 1
--snapshot_memory_limit 2M: each misuse raises one exception naming the fix, and the snapshot
taken before it is still the one restore() brings back; then the background write against an
optimizer's step and an in-place change (background_write). Prints "bad use ok" or exits 1
naming what was wrong."""
import sys

import torch
import torch.distributed as dist

import fsdprun


def expect(kind, words, call):
    try:
        call()
    except kind as e:
        if all(w in str(e) for w in words):
            print(f"{kind.__name__}: {e}")
            return None
        return f"{kind.__name__} without {words}: {e}"
    return f"no {kind.__name__} for {words}"


def background_write():
    """The background write (snapshot(background=True)) with a copy slowed to 300 ms: an optimizer's
    step() waits for it, so the piece holds the values from before the step; a tensor changed in
    place outside step() while it is copied drops that step's piece (the earlier one stays) and
    turns later snapshots to the foreground."""
    import os
    from fsdprun import _snapshot
    os.environ["FSDPRUN_TEST_SNAPSHOT_DELAY_MS"] = "1000"  # the in-place change must fall in it
    p = torch.nn.Parameter(torch.arange(6.0))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.ones(6)
    fsdprun.snapshot(6, {"p": p.detach()}, background=True)
    opt.step()  # must wait for the copy: the piece keeps 0..5, not -1..4
    restored = fsdprun.restore()
    if restored is None or restored[0] != 6 or not torch.equal(restored[1]["p"], torch.arange(6.0)):
        return f"the optimizer's step did not wait for the background write: restore() gave {restored}"
    w = torch.zeros(8)
    fsdprun.snapshot(7, {"w": w}, background=True)
    w.add_(1)  # in place, outside any step(), while the copy sleeps
    fsdprun.wait()
    restored = fsdprun.restore()
    if restored is None or restored[0] != 6:
        return f"a state changed during its background write was kept: restore() gave {restored}"
    if not _snapshot._snaps.torn_once:
        return "the torn write did not turn later snapshots to the foreground"
    fsdprun.snapshot(8, {"w": w}, background=True)  # the foreground now: no delay applies
    w.add_(1)
    restored = fsdprun.restore()
    del os.environ["FSDPRUN_TEST_SNAPSHOT_DELAY_MS"]
    if restored is None or restored[0] != 8 or not torch.equal(restored[1]["w"], torch.ones(8)):
        return f"the foreground snapshot after a torn one: restore() gave {restored}"
    print("background write ok")
    return None


def main() -> int:
    problems = []
    state = {"w": torch.arange(4.0), "step": 1, "name": "a", "nested": [1.5, (2, None)], "nan": float("nan")}
    problems.append(expect(RuntimeError, ["init_process_group()"], lambda: fsdprun.snapshot(1, state)))
    dist.init_process_group("gloo")
    fsdprun.snapshot(1, state)
    problems.append(expect(TypeError, ["state['extra'] is a object", "convert it"],
                           lambda: fsdprun.snapshot(2, {"w": state["w"], "extra": object()})))
    big = {"w": torch.zeros(1 << 20)}  # 4 MiB: over the 2 MiB limit
    problems.append(expect(RuntimeError, ["--snapshot_memory_limit", "taken before are kept"],
                           lambda: fsdprun.snapshot(3, big)))
    restored = fsdprun.restore()
    if restored is None:
        problems.append("restore() found nothing: the snapshot of step 1 went")
    else:
        step, back = restored
        if step != 1 or not torch.equal(back["w"], state["w"]) or back["nested"] != [1.5, (2, None)] \
                or back["name"] != "a" or back["nan"] == back["nan"]:
            problems.append(f"restore() gave step {step} and {back}, not the snapshot of step 1")
    problems.append(background_write())
    problems = [p for p in problems if p]
    if problems:
        print("bad use FAILED: " + "; ".join(problems), file=sys.stderr)
        return 1
    print("bad use ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
