"""fsdprun's runtime for PyTorch scripts: what libfsdp programs get, from Python.

Under ``fsdprun`` (the agent puts this package on every worker's ``PYTHONPATH``)::

    import fsdprun

    state = fsdprun.restore()                 # (step, state) after a failure, None on a first start
    if state is not None:
        step, saved = state
        model.load_state_dict(saved["model"]); optimizer.load_state_dict(saved["optimizer"])
    for step in range(step, steps):
        ...forward, backward, optimizer.step()...
        fsdprun.report_step(samples=len(x), loss=loss.item())   # optional: the step split, /metrics
        fsdprun.mark_progress(step + 1)                          # the hang watchdog judges this rank
        fsdprun.snapshot(step + 1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})

- ``mark_progress`` writes a progress mark into the worker's flight ring (a few stores into shared
  memory): the agent's watchdog (``--hang_timeout``) then judges this rank as it judges libfsdp
  ranks. A script that never calls it is judged as before (not at all).
- Python stacks: importing the module registers ``faulthandler`` for a signal the agent sends when
  it declares a hang (or when a worker of the node fails in its collective's timeout): the report
  shows every Python thread's file, line and function, beside the native stack. Nothing runs
  until the agent asks.
- ``record_ddp(model)`` records each backward of a DDP model in the ring as one allreduce, so the
  report says who waits in it and who never entered it.
- ``snapshot(step, state)`` copies ``state`` (nested dicts, lists and tuples of tensors and plain
  values: ``model.state_dict()``, ``optimizer.state_dict()``) into a sealed memfd the node's agent
  holds across this process's death; a background thread copies it to the next node's agent
  while the next forward and backward run (the next optimizer ``step()`` waits for it, so a lost
  node redoes at most one step). ``restore()`` brings back the newest step every rank
  holds (own node's memory, else a lost node's peer copy). The cost is one copy of the state per
  call (memory bandwidth), plus the peer copy off the training thread.
- ``report_step`` with ``mark_progress`` gives the step split of libfsdp ranks as far as Python sees
  it: the time waiting for data (``data_wait()``) and the rest (compute; DDP's allreduces overlap
  the backward and are not split out); and the samples, tokens and loss of ``/metrics``.

Outside fsdprun (``python train.py``) every call returns at once and ``restore()`` returns None.
"""
from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import threading
from typing import Any, Iterator, Optional, Tuple

from . import _ring

__all__ = ["enabled", "mark_progress", "report_step", "data_wait", "record_ddp", "snapshot", "wait",
           "restore", "restored_from"]


def enabled() -> bool:
    """Whether this process runs under fsdprun (its agent gave it a flight ring)."""
    return "FSDPRUN_FLIGHT_FD" in os.environ or _state.ring is not None


class _State:
    """The process's one view of its ring and its step timing (under ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ring: Optional[_ring.Ring] = None
        self.tried = False
        self.attached = False
        self.raw_data = 0
        self.data_at_mark = 0
        self.raw_wait = 0  # DDP's tail waits (record_ddp), summed
        self.wait_at_mark = 0
        self.samples_at_mark = 0
        self.tokens_at_mark = 0
        self.last_mark = 0
        self.last_step = -1
        self.timing = {"steps": 0, "step_ns": 0, "wait_ns": 0, "data_ns": 0, "last_step_ns": 0,
                       "last_wait_ns": 0, "last_data_ns": 0, "samples": 0, "tokens": 0,
                       "last_samples": 0, "last_tokens": 0, "loss": math.nan}

    def get_ring(self) -> Optional[_ring.Ring]:
        if not self.tried:
            self.tried = True
            fd_text = os.environ.get("FSDPRUN_FLIGHT_FD")
            self.ring = _ring.open_ring()
            if fd_text is not None:
                # A program this one starts must not write into it.
                os.environ.pop("FSDPRUN_FLIGHT_FD", None)
                with contextlib.suppress(OSError, ValueError):
                    os.set_inheritable(int(fd_text), False)
        return self.ring

    def attached_ring(self) -> Optional[_ring.Ring]:
        ring = self.get_ring()
        if ring is not None and not self.attached:
            ring.attach(int(os.environ.get("RANK", "0")))
            self.attached = True
        return ring


_state = _State()


def mark_progress(step: int, what: str = "step") -> None:
    """Records that this rank completed ``step`` (any increasing number; negative: activity without
    a step). ``what`` (up to 23 characters) says who marks. A few stores into shared memory."""
    ring = _state.attached_ring()
    if ring is None:
        return
    ring.mark_progress(int(step), what)
    if step < 0:
        return
    s = _state
    with s.lock:
        if s.last_mark != 0 and step == s.last_step:
            return  # the same step marked again is activity
        s.last_step = step
        now = _ring.now_ns()
        if s.last_mark != 0:
            t = s.timing
            t["last_step_ns"] = now - s.last_mark
            t["last_data_ns"] = min(s.raw_data - s.data_at_mark, t["last_step_ns"])
            t["last_wait_ns"] = min(s.raw_wait - s.wait_at_mark, t["last_step_ns"] - t["last_data_ns"])
            t["last_samples"] = t["samples"] - s.samples_at_mark
            t["last_tokens"] = t["tokens"] - s.tokens_at_mark
            t["step_ns"] += t["last_step_ns"]
            t["wait_ns"] += t["last_wait_ns"]
            t["data_ns"] += t["last_data_ns"]
            t["steps"] += 1
        s.data_at_mark = s.raw_data
        s.wait_at_mark = s.raw_wait
        s.samples_at_mark, s.tokens_at_mark = s.timing["samples"], s.timing["tokens"]
        s.last_mark = now
        ring.publish_timing(s.timing)


def report_step(samples: int = 0, tokens: int = 0, loss: Optional[float] = None) -> None:
    """This rank's samples and tokens in the step about to be marked, and its loss: the figures of
    the agent's ``/metrics``. Call it before ``mark_progress``."""
    if _state.get_ring() is None:
        return
    with _state.lock:
        _state.timing["samples"] += int(samples)
        _state.timing["tokens"] += int(tokens)
        _state.timing["loss"] = math.nan if loss is None else float(loss)


@contextlib.contextmanager
def data_wait() -> Iterator[None]:
    """While inside, the training thread waits for input data: the step split counts it as data.
    ``for x, y in fsdprun.data(loader)`` style loops wrap ``next()`` in it."""
    start = _ring.now_ns()
    try:
        yield
    finally:
        if _state.get_ring() is not None:
            with _state.lock:
                _state.raw_data += _ring.now_ns() - start


def record_ddp(model: Any) -> Any:
    """Records each backward of ``model`` (a ``DistributedDataParallel``) in the flight ring as one
    allreduce of the group "ddp" (its count: the elements DDP reduces): opened when the backward
    starts, completed once DDP has waited for every bucket. A rank that never reaches its
    backward while the others wait in theirs is then named: ``rank 1 never entered ddp #14``.
    Returns ``model``; outside fsdprun it registers nothing. No communication hook (the model
    keeps its own, or DDP's default), no callback on Gloo's threads.

    The step split's collective wait is DDP's tail: from the last gradient the backward computed
    (a hook on each trainable parameter stamps the time) to the end of DDP's finalization, which
    waits for every bucket's allreduce. A rank that waits there for a slower one shows it; the
    waits of earlier buckets overlap its own backward and are not seen, and the copy of reduced
    gradients back (without ``gradient_as_bucket_view``) counts as waiting. With it, the agents
    name a rank whose compute stands out (straggler lines, as libfsdp's rank 0 writes them)."""
    ring = _state.attached_ring()
    if ring is None:
        return model
    import torch
    import torch.distributed as dist
    from torch.autograd import Variable

    group = getattr(model, "process_group", None) or dist.group.WORLD
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dtype = next((str(p.dtype).replace("torch.", "") for p in model.parameters() if p.requires_grad), "")
    seq = [0]
    open_index: list = []
    last_grad = [0]

    def stamp(grad):  # noqa: ANN001, ANN202
        last_grad[0] = _ring.now_ns()

    def complete() -> None:
        for index in open_index:
            ring.complete(index, True)
        open_index.clear()
        if last_grad[0]:
            waited = _ring.now_ns() - last_grad[0]
            last_grad[0] = 0
            with _state.lock:
                _state.raw_wait += waited

    def after_ddp() -> None:
        # The engine runs callbacks queued while it runs them: this one goes after DDP's own
        # finalization, which waits for every bucket's allreduce.
        Variable._execution_engine.queue_callback(complete)

    def backward_starts(grad):  # noqa: ANN001, ANN202
        seq[0] += 1
        open_index.append(ring.issue("ddp", size, rank, seq[0], _ring.OP_ALL_REDUCE, count, dtype,
                                     "ddp backward"))
        ring.add_bytes(count * 4)
        Variable._execution_engine.queue_callback(after_ddp)
        return grad

    def forward_done(module, inputs, output):  # noqa: ANN001, ANN202
        if not torch.is_grad_enabled():
            return None
        stack = [output]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                if item.requires_grad:
                    item.register_hook(backward_starts)
                    return None
            elif isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
        return None

    model.register_forward_hook(forward_done)
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(stamp)
    return model


def _register_stacks() -> None:
    """faulthandler for the agent's signal, into the memfd it gave (FSDPRUN_PYSTACK_FD); the first
    line tells the agent the handler is there (the signal's default action would end us)."""
    fd_text = os.environ.pop("FSDPRUN_PYSTACK_FD", None)
    signal_text = os.environ.get("FSDPRUN_PYSTACK_SIGNAL")
    if fd_text is None or signal_text is None:
        return
    try:
        fd = int(fd_text)
        signum = int(signal_text)
        os.set_inheritable(fd, False)
        faulthandler.register(signum, file=fd, all_threads=True, chain=False)
        os.write(fd, f"fsdprun-pystacks signal={signum} pid={os.getpid()}\n".encode())
    except (ValueError, OSError, RuntimeError):
        return


_register_stacks()

from ._snapshot import restore, restored_from, snapshot, wait  # noqa: E402  (needs the names above)
