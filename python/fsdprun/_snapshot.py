"""In-memory snapshots of a PyTorch script's state, held by fsdprun's agents.

Speaks the keeper protocol of ``common/include/fsdp/common/snapshot_wire.hpp`` and
``launcher/include/fsdp/launcher/snapshot_keeper.hpp``: a piece is a sealed memfd ("FSDPSNP1",
the data offset, the header length, a JSON header, the data at 4096-aligned offsets) handed to the
node's agent over an abstract SOCK_SEQPACKET socket (FSDPRUN_SNAPSHOT_SOCKET); a copy goes to the
next node's agent over TCP (length-prefixed JSON frames, an HMAC under the job token), sent by a
background thread (the wires: ``_wire.py``). The header's "meta" holds the state's tree:
{"d": [[key, value], ...]} for a dict, {"l": [...]} a list, {"u": [...]} a tuple, {"t": i} the
i-th tensor of "blocks", {"v": x} a plain value, {"f": "nan"} a non-finite float.
"""
from __future__ import annotations

import concurrent.futures
import fcntl
import functools
import hashlib
import hmac
import json
import logging
import math
import mmap
import os
import queue
import socket
import struct
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from ._wire import Keeper, connect, read_frame, receive_piece, send_piece, write_frame

MAGIC = b"FSDPSNP1"
PREFIX_BYTES = 24
ALIGN = 4096

_log = logging.getLogger("fsdprun")


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _dist():
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fsdprun.snapshot/restore: call torch.distributed.init_process_group() first "
                           "(every rank takes part: the ranks agree on the step to restore)")
    return dist


# -- the state's tree ------------------------------------------------------------------------

def _encode(value: Any, tensors: List[Any], path: str) -> Any:
    import torch
    if isinstance(value, torch.Tensor):
        if value.is_sparse or value.layout != torch.strided:
            raise TypeError(f"fsdprun.snapshot: state{path} is a {value.layout} tensor: only dense "
                            f"(strided) tensors can be held; call .to_dense() or leave it out")
        tensors.append(value)
        return {"t": len(tensors) - 1}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return {"v": value}
    if isinstance(value, float):
        return {"v": value} if math.isfinite(value) else {"f": repr(value)}
    if isinstance(value, dict):
        return {"d": [[_encode(k, tensors, f"{path}[{k!r}] (a key)"), _encode(v, tensors, f"{path}[{k!r}]")]
                      for k, v in value.items()]}
    if isinstance(value, list):
        return {"l": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, tuple):
        return {"u": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]}
    raise TypeError(f"fsdprun.snapshot: state{path} is a {type(value).__name__}: a snapshot holds tensors, "
                    f"dicts, lists, tuples, int, float, bool, str and None; convert it (.item(), "
                    f".tolist(), str()) or leave it out")


def _decode(node: Dict[str, Any], tensors: List[Any]) -> Any:
    if "t" in node:
        return tensors[node["t"]]
    if "v" in node:
        return node["v"]
    if "f" in node:
        return float(node["f"])
    if "d" in node:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in node["d"]}
    if "l" in node:
        return [_decode(v, tensors) for v in node["l"]]
    if "u" in node:
        return tuple(_decode(v, tensors) for v in node["u"])
    raise ValueError(f"a malformed snapshot tree node: {str(node)[:100]}")


class _Buffer:
    """A piece's memory, written again once the agent no longer holds the step it last held (no
    fresh pages to fault in every step): a memfd sealed against growing and shrinking, mapped
    once."""

    def __init__(self, size: int):
        import torch
        self.size = size
        self.step = -1        # the step it holds, -1: free
        self.copying = False  # the copy to the next node reads it
        self.fd = os.memfd_create("fsdprun-snapshot", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    def close(self) -> None:
        del self.bytes  # no view of the mapping may outlive it
        self.map.close()
        os.close(self.fd)


class _Snapshots:
    """The process's snapshots: its keeper, its peer, the copy thread, the buffers."""

    def __init__(self) -> None:
        self.keeper: Optional[Keeper] = None
        self.tried = False
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.group_rank = int(os.environ.get("GROUP_RANK", "0"))
        self.groups = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        self.round = int(os.environ.get("FSDPRUN_ROUND", "0"))
        self.run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        self.limit = int(os.environ.get("FSDPRUN_SNAPSHOT_MEMORY_LIMIT", "0") or 0)
        self.endpoint = os.environ.get("FSDPRUN_SNAPSHOT_PEER", "")
        self.token = b""
        self.peer: Optional[str] = None  # the next node's keeper, once known
        self.endpoints: Dict[int, str] = {}
        self.copies: "queue.Queue" = queue.Queue()
        self.copy_thread: Optional[threading.Thread] = None
        self.peer_failed = False
        self.restored_from = ""
        self.buffers: List[_Buffer] = []
        self.held: set = set()  # this rank's steps the agent said it still holds
        self.lock = threading.Lock()  # the buffers' copying flags (the copy thread clears them)
        # The piece's write and its hand-over to the agent, off the training thread (snapshot()'s
        # background=True, opted in): one at a time; the next snapshot, wait(), restore() and every
        # optimizer's step() wait for it first (the step is what changes a state in place).
        self.writer: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.pending: Optional[concurrent.futures.Future] = None
        self.late_error: Optional[BaseException] = None  # a background write's, raised at the next call
        self.hooked = False
        self.torn_once = False  # a state changed during a background write: written in the foreground

    def buffer_for(self, size: int) -> _Buffer:
        """A buffer of `size` bytes the agent no longer holds and nothing reads."""
        with self.lock:
            for b in self.buffers:
                if b.size == size and b.step not in self.held and not b.copying:
                    return b
            # Buffers of another size, free: a state that changed shape.
            for b in [b for b in self.buffers if b.size != size and b.step not in self.held and not b.copying]:
                self.buffers.remove(b)
                b.close()
        b = _Buffer(size)
        self.buffers.append(b)
        return b

    def active(self) -> bool:
        if not self.tried:
            self.tried = True
            name = os.environ.get("FSDPRUN_SNAPSHOT_SOCKET")
            if name:
                try:
                    self.keeper = Keeper(name)
                except OSError as e:
                    _log.warning("fsdprun: rank %d: no in-memory snapshots: %s", self.rank, e)
                token_file = os.environ.get("FSDPRUN_TOKEN_FILE")
                if token_file:
                    with open(token_file, "rb") as f:
                        self.token = f.readline().strip()
        return self.keeper is not None

    def learn_endpoints(self) -> None:
        """Every node's keeper endpoint (a collective: every rank's first snapshot or restore)."""
        if self.endpoints:
            return
        dist = _dist()
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.group_rank, self.endpoint))
        self.endpoints = {g: e for g, e in gathered}
        if self.groups > 1:
            self.peer = self.endpoints.get((self.group_rank + 1) % self.groups) or None

    # -- the background write --------------------------------------------------------------
    def drain(self) -> None:
        """Waits for the write in flight; its error is kept for the next snapshot() or wait()."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.result()
        except BaseException as e:  # noqa: BLE001 - re-raised where the script can act on it
            self.late_error = e

    def raise_late(self) -> None:
        error, self.late_error = self.late_error, None
        if error is not None:
            raise error

    def submit(self, job) -> None:  # noqa: ANN001
        if self.writer is None:
            self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fsdprun-snapshot")
        self.hook_optimizers()
        self.pending = self.writer.submit(job)

    def settle(self) -> None:
        """Waits for the write in flight, then for the copies to the next node queued so far."""
        self.drain()
        if self.copy_thread is not None:
            self.copies.join()

    def hook_optimizers(self) -> None:
        """Every optimizer's step() waits first (settle()) for the write in flight (the step changes
        parameters and the optimizer's state in place) and for the copy to the next node of the
        snapshot before it (so a lost node leaves its last snapshot on the next node, and redoes
        at most the step it was in, as libfsdp's Snapshotter::step() does): PyTorch 2.x's global
        pre-hook; on 1.13, which has none, the step() of every optimizer class defined by now,
        wrapped once."""
        if self.hooked:
            return
        self.hooked = True
        import torch
        import torch.optim.optimizer as optim
        if hasattr(optim, "register_optimizer_step_pre_hook"):
            optim.register_optimizer_step_pre_hook(lambda *_: self.settle())
            return
        classes, seen = [torch.optim.Optimizer], set()
        while classes:
            c = classes.pop()
            if c in seen:
                continue
            seen.add(c)
            classes.extend(c.__subclasses__())
            step = c.__dict__.get("step")
            if step is None or getattr(step, "_fsdprun_waits", False):
                continue

            @functools.wraps(step)
            def waiting_step(*args, __step=step, **kwargs):  # noqa: ANN002, ANN003, ANN202
                self.settle()
                return __step(*args, **kwargs)

            waiting_step._fsdprun_waits = True
            c.step = waiting_step

    # -- the background copy to the next node ------------------------------------------------
    def queue_copy(self, buffer: _Buffer, step: int, size: int) -> None:
        if self.peer is None or self.peer_failed:
            return
        self.hook_optimizers()
        if self.copy_thread is None:
            self.copy_thread = threading.Thread(target=self._copy_loop, name="fsdprun-peer-copy", daemon=True)
            self.copy_thread.start()
        with self.lock:
            buffer.copying = True
        self.copies.put((buffer, step, size))

    def _copied(self, buffer: _Buffer) -> None:
        with self.lock:
            buffer.copying = False

    def _copy_loop(self) -> None:
        sock: Optional[socket.socket] = None
        while True:
            buffer, step, size = self.copies.get()
            fd = buffer.fd
            try:
                # Only the newest matters: an older one still queued is dropped.
                while not self.copies.empty():
                    self._copied(buffer)
                    self.copies.task_done()
                    buffer, step, size = self.copies.get()
                    fd = buffer.fd
                if self.peer_failed:
                    continue
                delay = os.environ.get("FSDPRUN_TEST_PEER_COPY_DELAY_MS")  # tests: a slow network, made so
                if delay:
                    time.sleep(float(delay) / 1000)
                if sock is None:
                    sock = connect(self.peer, 60)
                mac = hmac.new(self.token, f"fsdprun-snapshot|{self.run}|{self.rank}|{self.world}|{step}|{size}"
                               .encode(), hashlib.sha256).hexdigest()
                write_frame(sock, json.dumps({"run": self.run, "rank": self.rank, "world": self.world, "step": step,
                                         "bytes": size, "mac": mac}))
                send_piece(sock, fd, size)
                reply = read_frame(sock)
                if not reply.get("ok"):
                    raise RuntimeError(reply.get("error", "refused"))
            except (OSError, RuntimeError, ValueError) as e:
                self.peer_failed = True
                _log.warning("fsdprun: rank %d: no peer copies of snapshots from now on (%s): a lost node "
                             "resumes from an older step", self.rank, e)
                if sock is not None:
                    sock.close()
                    sock = None
            finally:
                self._copied(buffer)
                self.copies.task_done()


_snaps = _Snapshots()


def _layout(step: int, tree: Any, tensors: List[Any]) -> Tuple[bytes, List[Dict[str, Any]], int, int]:
    """The piece's header, its blocks, the data's offset and the piece's size; raises where the
    piece would pass the agent's snapshot memory. Reads no tensor's data."""
    blocks = []
    cursor = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        blocks.append({"offset": cursor, "bytes": nbytes, "dtype": str(t.dtype).replace("torch.", ""),
                       "shape": list(t.shape)})
        cursor = _align(cursor + nbytes, 64)
    header = json.dumps({"rank": _snaps.rank, "world": _snaps.world, "step": step, "round": _snaps.round,
                         "meta": {"format": "fsdprun-python", "version": 1, "tree": tree},
                         "blocks": blocks}).encode()
    # Padded with spaces (JSON allows them) to a multiple of 2 KiB: a step number one digit longer
    # does not move the data, so the same buffer serves again.
    header += b" " * (_align(len(header), 2048) - len(header))
    data_offset = _align(PREFIX_BYTES + len(header), ALIGN)
    total = data_offset + max(_align(cursor, ALIGN), ALIGN)
    if _snaps.limit and total > _snaps.limit:
        raise RuntimeError(f"fsdprun.snapshot: the state of step {step} takes {total} bytes, more than the "
                           f"agent's snapshot memory ({_snaps.limit} bytes, --snapshot_memory_limit): raise "
                           f"--snapshot_memory_limit, or snapshot less; the snapshots taken before are kept")
    return header, blocks, data_offset, total


def _versions(tensors: List[Any]) -> List[Optional[int]]:
    """Each tensor's version counter (bumped by every in-place change), None where it has none."""
    out: List[Optional[int]] = []
    for t in tensors:
        try:
            out.append(t._version)
        except (RuntimeError, AttributeError):  # inference tensors keep no counter
            out.append(None)
    return out


def _fill(layout: Tuple[bytes, List[Dict[str, Any]], int, int], tensors: List[Any]) -> Tuple[_Buffer, int]:
    import torch
    header, blocks, data_offset, total = layout
    buffer = _snaps.buffer_for(total)
    buffer.step = -1  # being written: holds nothing
    m = buffer.map
    m[0:PREFIX_BYTES] = MAGIC + struct.pack("<QQ", data_offset, len(header))
    m[PREFIX_BYTES:PREFIX_BYTES + len(header)] = header
    for block, t in zip(blocks, tensors):
        if block["bytes"] == 0:
            continue
        start = data_offset + block["offset"]
        c = t.detach()
        if c.device.type != "cpu":
            c = c.cpu()
        buffer.bytes[start:start + block["bytes"]].copy_(c.contiguous().reshape(-1).view(torch.uint8))
    return buffer, total


def snapshot(step: int, state: Any, background: bool = False) -> None:
    """Hands ``state`` (after ``step``) to this node's agent, which holds it across this process's
    death; a background thread copies it to the next node's agent while the next step's forward
    and backward run, and every optimizer's ``step()`` waits for that copy (as libfsdp's
    snapshots do), so a lost node leaves this step on the next node. Every rank calls it at the
    same steps (its first call is collective: the ranks learn where the next node's agent
    listens). Active under fsdprun with ``--max_restarts`` > 0; elsewhere it does nothing.

    ``background=True``: the tensors' bytes are copied into the piece and handed to
    the agent on a thread of this module while the script goes on; every optimizer's ``step()``,
    the next ``snapshot()``, ``wait()`` and ``restore()`` wait for it first, since a state's
    tensors change in place in ``step()``. A tensor changed in place anywhere else before the
    copy ended (an EMA, a buffer updated outside ``step()``) is caught by its version counter: that
    step's piece is dropped (the previous one stays), one log line says so, and later snapshots
    are written in the foreground. The price: the step being written when a worker is killed is
    lost (one more step redone), and the copy to the next node starts a step later (a lost node
    may redo two). ``background=False`` (the default) writes before returning: at most one step
    redone either way.

    Raises TypeError for a value a snapshot cannot hold (naming where it is in ``state``),
    RuntimeError before ``init_process_group`` and for a state larger than the agent's snapshot
    memory; the agent's refusal of a background write is raised by the next ``snapshot()`` or
    ``wait()``. The snapshots taken before are left as they were."""
    if not _snaps.active():
        return
    tensors: List[Any] = []
    tree = _encode(state, tensors, "")
    _snaps.learn_endpoints()
    _snaps.drain()
    _snaps.raise_late()
    step = int(step)
    layout = _layout(step, tree, tensors)
    if not background or _snaps.torn_once:
        _hand_over(step, *_fill(layout, tensors))
        return
    before = _versions(tensors)

    def write() -> None:
        delay = os.environ.get("FSDPRUN_TEST_SNAPSHOT_DELAY_MS")  # tests: a slow copy, made so
        if delay:
            time.sleep(float(delay) / 1000)
        buffer, size = _fill(layout, tensors)
        changed = [i for i, (a, b) in enumerate(zip(before, _versions(tensors))) if a != b]
        if changed:
            _snaps.torn_once = True
            _log.warning("fsdprun: rank %d: %d tensor(s) of the state of step %d changed in place while the "
                         "snapshot copied them (outside an optimizer's step()): that snapshot is dropped, "
                         "the ones after it are written before snapshot() returns", _snaps.rank, len(changed),
                         step)
            return
        _hand_over(step, buffer, size)

    _snaps.submit(write)


def _hand_over(step: int, buffer: _Buffer, size: int) -> None:
    """The written piece to this node's agent, then queued for the next node's."""
    answer, _ = _snaps.keeper.ask({"op": "put", "rank": _snaps.rank, "world": _snaps.world, "step": step,
                                   "round": _snaps.round}, buffer.fd)
    if not answer.get("ok"):
        _snaps.held = set()
        raise RuntimeError(f"fsdprun.snapshot: the agent refused the snapshot of step {step}: "
                           f"{answer.get('error', 'no reason given')} (raise --snapshot_memory_limit)")
    buffer.step = step
    # What the agent no longer holds is this process's to write again.
    _snaps.held = set(answer.get("held", [step]))
    _snaps.queue_copy(buffer, step, size)


def wait() -> None:
    """Waits until the snapshot written in the background is with this node's agent (raising the
    agent's refusal of it) and the copies to the next node's agent queued so far are sent (or
    failed)."""
    _snaps.settle()
    _snaps.raise_late()


def _read_piece(fd: int) -> Tuple[int, Any]:
    import torch
    size = os.fstat(fd).st_size
    # A private mapping: writable for torch.frombuffer, and nothing written reaches the piece
    # (a peer copy is sealed against writes; our own is the agent's to keep as it is).
    with mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE) as m:
        if m[0:8] != MAGIC:
            raise ValueError("not a snapshot piece")
        data_offset, header_bytes = struct.unpack_from("<QQ", m, 8)
        header = json.loads(m[PREFIX_BYTES:PREFIX_BYTES + header_bytes])
        meta = header.get("meta", {})
        if meta.get("format") != "fsdprun-python":
            raise ValueError("a snapshot of a libfsdp program, not of a Python script")
        whole = torch.frombuffer(m, dtype=torch.uint8)
        tensors = []
        for b in header["blocks"]:
            dtype = getattr(torch, b["dtype"])
            start = data_offset + b["offset"]
            # One copy, out of the mapping (which goes when this returns).
            tensors.append(whole[start:start + b["bytes"]].view(dtype).reshape(b["shape"]).clone())
        del whole
        return int(header["step"]), _decode(meta["tree"], tensors)


def _fetch_remote(endpoint: str, rank: int, world: int, step: int) -> int:
    """Rank `rank`'s piece (of `world`, at `step`) from another node's agent, into a memfd."""
    mac = hmac.new(_snaps.token, f"fsdprun-snapshot-get|{_snaps.run}|{rank}|{world}|{step}".encode(),
                   hashlib.sha256).hexdigest()
    with connect(endpoint, 60) as sock:
        write_frame(sock, json.dumps({"op": "get", "run": _snaps.run, "rank": rank, "world": world,
                                      "step": step, "mac": mac}))
        reply = read_frame(sock)
        if not reply.get("ok"):
            raise RuntimeError(reply.get("error", "refused"))
        return receive_piece(sock, int(reply["bytes"]))


def _holders(gathered: List[Any]) -> Tuple[Dict[Tuple[int, int, int], List[int]], set]:
    """From every node's (group rank, listed pieces): the nodes holding each (rank, world, step),
    and the worlds held. A piece of an older round at or after the first step any node holds of
    a newer round is left out: it lies on a trajectory that round left (it resumed from before
    it, and the steps it redid need not be the same bits), never to be mixed with the newer."""
    first_step: Dict[int, int] = {}
    for _, held in gathered:
        for p in held:
            r = p.get("round", 0)
            first_step[r] = min(first_step.get(r, p["step"]), p["step"])
    holders: Dict[Tuple[int, int, int], List[int]] = {}
    worlds = set()
    for group_rank, held in gathered:
        for p in held:
            if any(r > p.get("round", 0) and s <= p["step"] for r, s in first_step.items()):
                continue
            worlds.add(p["world"])
            nodes = holders.setdefault((p["rank"], p["world"], p["step"]), [])
            if group_rank not in nodes:
                nodes.append(group_rank)
    return holders, worlds


def restored_from() -> str:
    """After a ``restore()`` that returned a state: "memory" (every rank's own piece from its own
    node's agent) or "peer copy" (some piece came from another node); "" before."""
    return _snaps.restored_from


def restore(replicated: bool = False) -> Optional[Tuple[int, Any]]:
    """``(step, state)`` of the newest step of which every rank's snapshot is held by some node's
    agent (this node's memory, else the peer copy a lost node left on the next node), or None: a
    first start, snapshots of another world size (one log line says so), or none that every rank
    could read (then none restores). Collective: every rank calls it. Outside fsdprun: None.

    ``replicated=True``: every rank's state is the same (DDP: the model and the optimizer are
    replicas), so after the world changed (a node lost, ``--nnodes MIN:MAX``) rank r takes the
    newest step's piece of old rank r (rank 0's where the old world had no rank r)."""
    if not _snaps.active():
        return None
    _snaps.drain()
    dist = _dist()
    start = time.monotonic()
    listed, _ = _snaps.keeper.ask({"op": "list"})
    pieces = listed.get("pieces", [])
    _snaps.learn_endpoints()
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (_snaps.group_rank, pieces))
    holders, worlds = _holders(gathered)

    def source(rank: int, world: int) -> int:
        return rank if rank < world else 0

    # Newest step first; at one step, the current world before another.
    candidates = sorted({(s, w) for (_, w, s) in holders if w == _snaps.world or replicated},
                        key=lambda sw: (sw[0], sw[1] == _snaps.world), reverse=True)
    found = next(((s, w) for s, w in candidates
                  if all((source(r, w), w, s) in holders for r in range(_snaps.world))), None)
    if found is None:
        if _snaps.rank == 0 and worlds and _snaps.world not in worlds:
            _log.warning("fsdprun: the in-memory snapshots are of world size %s, this job has %d ranks: none "
                         "restored (restore(replicated=True) takes a replicated state, DDP's, across world "
                         "sizes)", sorted(worlds), _snaps.world)
        elif _snaps.rank == 0 and holders:
            _log.warning("fsdprun: no step is held for every rank of world %d (a node and its peer-copy holder "
                         "lost together?): none restored", _snaps.world)
        return None
    chosen, old_world = found
    src = source(_snaps.rank, old_world)
    mine = holders[(src, old_world, chosen)]
    result: Optional[Tuple[int, Any]] = None
    error = ""
    source = "memory"
    try:
        if _snaps.group_rank in mine:
            answer, fd = _snaps.keeper.ask({"op": "get", "rank": src, "world": old_world, "step": chosen})
            if not answer.get("ok") or fd is None:
                raise RuntimeError(answer.get("error", "this node's agent no longer holds it"))
            source = "peer copy" if answer.get("peer") else "memory"
        else:
            fd = _fetch_remote(_snaps.endpoints[mine[0]], src, old_world, chosen)
            source = "peer copy"
        try:
            result = _read_piece(fd)
        finally:
            os.close(fd)
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        error = f"rank {_snaps.rank}: {e}"
    outcomes: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (error, source))
    errors = [e for e, _ in outcomes if e]
    if errors:
        if _snaps.rank == 0:
            _log.warning("fsdprun: the in-memory snapshot of step %d was not restored: %s", chosen, "; ".join(errors))
        return None
    _snaps.restored_from = "peer copy" if any(s == "peer copy" for _, s in outcomes) else "memory"
    if _snaps.rank == 0:
        across = "" if old_world == _snaps.world else f" (a replicated state of world {old_world} into world " \
                                                      f"{_snaps.world})"
        _log.warning("fsdprun: restored step %d from %s%s in %.0f ms", chosen, _snaps.restored_from, across,
                     1000 * (time.monotonic() - start))
    return result
