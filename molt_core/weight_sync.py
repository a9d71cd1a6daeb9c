"""Actor -> engines weight sync: every trainer rank gathers (a collective, so all ranks take part),
rank 0 sends versioned buckets of `trainer.weight_sync_bucket_mb` to every engine, then each
engine checks every parameter was assigned. Transports (`ray`, `broadcast`: the `WeightGroup`,
`shm`: the `ShmChannel`) and checksums (`WeightMismatchError`): docs/scaling.md, "Weight sync"."""

from __future__ import annotations

import math
import os
import tempfile
import time
import uuid
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, Protocol

import ray
import torch
import torch.distributed as dist

from molt_core.run import actors
from molt_core.run.cluster import rendezvous

__all__ = ["Meta", "Receiver", "ShmChannel", "WeightGroup", "WeightMismatchError",
           "WeightSyncError", "checksums", "connect", "pack", "push", "send", "unpack"]

Meta = tuple[str, str, list[int], int]          # name, dtype ("float32"), shape, byte offset
_ALIGN = 64
_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class WeightSyncError(RuntimeError):
    """A trainer rank or an engine failed during a weight push."""


class WeightMismatchError(WeightSyncError):
    """An engine holds other weights than the trainer sent (checksum or canary)."""


class Receiver(Protocol):
    """What an engine (`contracts.Engine`) adds for transports `broadcast` and `shm`; each bucket
    is loaded as `update_weights` loads it."""

    async def weight_group_info(self) -> tuple[int, str]:
        """(ranks this engine adds to the `broadcast` group, its node IP)."""

    async def join_weight_group(self, host: str, port: int, rank: int, world_size: int,
                                backend: str, timeout_s: float) -> None:
        """`broadcast`: its i-th rank joins as `WeightGroup(.., rank + i, ..)`."""

    async def receive_weights(self, metas: list[Meta], version: int) -> None:
        """`broadcast`: one bucket from trainer rank 0 (`WeightGroup.receive`)."""

    async def receive_shm(self, path: str, nbytes: int, metas: list[Meta], version: int) -> None:
        """`shm`: one bucket from a `ShmChannel` file (`unpack`)."""


def push(workers: list, engines: list, version: int, bucket_bytes: int, timeout_s: float,
         transport: str = "ray") -> dict[str, Any]:
    """Push the trainer's weights to `engines` as `version`; returns rank 0's stats.

    Fails fast on the first rank error (engine timeouts surface there as `TimeoutError`); ranks
    stuck in a gather end at the trainer's process-group timeout."""
    refs = [w.push_weights.remote(engines, version, bucket_bytes, timeout_s, transport)
            for w in workers]
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done)
        except ray.exceptions.RayTaskError as e:
            rank = refs.index(done[0])
            if isinstance(e.cause, (TimeoutError, WeightMismatchError)):
                raise type(e.cause)(f"trainer rank {rank}: {e.cause}") from None
            raise WeightSyncError(f"weight push of version {version} failed on trainer rank "
                                  f"{rank}: {e.cause!r}") from e
        except ray.exceptions.RayError as e:
            raise WeightSyncError(f"weight push of version {version}: trainer rank "
                                  f"{refs.index(done[0])} died: {e}") from None
    return ray.get(refs[0])


def send(named: Iterable[tuple[str, torch.Tensor]], engines: list, version: int, bucket_bytes: int,
         timeout_s: float, group: WeightGroup | ShmChannel | None = None) -> dict[str, Any]:
    """Send full tensors `named` to `engines` in buckets (Ray, `group`, `ShmChannel`); finish."""
    t0 = time.perf_counter()
    total, buckets, bucket, size = 0, 0, [], 0
    sent: dict[str, tuple[int, int]] = {}       # name -> (bucket, checksum)

    def flush() -> None:
        what = f"bucket {buckets}, version {version}"
        sent.update((n, (buckets, c)) for (n, _), c in zip(bucket, checksums(bucket)))
        if isinstance(group, ShmChannel):
            slot = buckets % 2
            _wait(group.loading[slot], engines, timeout_s, f"receive_shm ({what})")
            path, metas, nbytes = group.fill(slot, bucket)
            group.loading[slot] = [e.receive_shm.remote(path, nbytes, metas, version)
                                   for e in engines]
            return
        if group is None:
            # ray.put copies; an embedded engine copies the tensors themselves
            ref = bucket if actors.is_local(engines) else ray.put(bucket)
            _wait([e.update_weights.remote(ref, version) for e in engines], engines, timeout_s,
                  f"update_weights ({what})")
            return
        metas, flat = pack(bucket)
        refs = [e.receive_weights.remote(metas, version) for e in engines]
        try:
            group.broadcast(flat, f"weight bucket ({what})")
        except Exception as e:
            raise WeightSyncError(f"weight sync: broadcast of {what} failed"
                                  f"{_dead(refs, engines)}: {e}") from None
        _wait(refs, engines, timeout_s, f"receive_weights ({what})")

    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            flush()
            buckets, bucket, size = buckets + 1, [], 0
        bucket.append((name, t if group is not None else t.cpu()))
        size += nbytes
        total += nbytes
    if bucket:
        flush()
        buckets += 1
    if isinstance(group, ShmChannel):
        for slot in (0, 1):
            _wait(group.loading[slot], engines, timeout_s, f"receive_shm (version {version})")
            group.loading[slot] = []
        group.unlink()
    _verify(_wait([e.finish_weight_update.remote(version) for e in engines], engines, timeout_s,
                  f"finish_weight_update (version {version})"), sent, engines, version)
    return {"bytes": total, "buckets": buckets, "seconds": time.perf_counter() - t0,
            "checksums": {n: c for n, (_, c) in sent.items()}}


def _verify(got: list, sent: dict[str, tuple[int, int]], engines: list, version: int) -> None:
    for i, sums in enumerate(got):      # None: an engine that keeps no checksums
        if bad := [n for n, c in (sums or {}).items() if n in sent and sent[n][1] != c]:
            raise WeightMismatchError(
                f"weight sync of version {version}: engine {i} ({engines[i]}) holds other bytes "
                f"than trainer rank 0 sent for {len(bad)} parameter(s), first '{bad[0]}' of "
                f"bucket {sent[bad[0]][0]} (checksum {sums[bad[0]]}, sent {sent[bad[0]][1]}): the "
                "transport or the engine's load changed them")


def connect(engines: list, timeout_s: float, transport: str = "broadcast"
            ) -> WeightGroup | ShmChannel:
    """Build the broadcast group (trainer rank 0, this process, + every engine worker), or for
    `shm` check that every engine shares this node and open the channel."""
    info = _wait([e.weight_group_info.remote() for e in engines], engines, timeout_s,
                 "weight_group_info")
    me = ray.util.get_node_ip_address()
    if transport == "shm":
        if remote := [i for i, (_, ip) in enumerate(info) if ip != me]:
            raise WeightSyncError(f"trainer.weight_sync_transport=shm needs every engine on "
                                  f"trainer rank 0's node ({me}); engines {remote} are not: use "
                                  "broadcast")
        return ShmChannel()
    ranks = [n for n, _ in info]
    world = 1 + sum(ranks)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    host = "127.0.0.1" if {ip for _, ip in info} <= {me} else me   # loopback unless remote peers
    store = rendezvous(host, timeout_s)
    refs = [e.join_weight_group.remote(host, store.port, 1 + sum(ranks[:i]), world, backend,
                                       timeout_s) for i, e in enumerate(engines)]
    try:
        group = WeightGroup(host, store.port, 0, world, backend, timeout_s, store)
    except Exception as e:
        raise WeightSyncError(f"weight sync: the broadcast group of {world} ranks (trainer rank "
                              f"0 + engine workers) did not form within {timeout_s}s"
                              f"{_dead(refs, engines)}: {e}") from None
    _wait(refs, engines, timeout_s, "join_weight_group")
    return group


def _wait(refs: list, engines: list, timeout_s: float, what: str) -> list:
    _, pending = actors.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for i, r in enumerate(refs):
        if r not in pending:
            try:
                actors.get(r)
            except ray.exceptions.RayActorError:
                raise WeightSyncError(f"weight sync: engine {i} ({engines[i]}) died during "
                                      f"{what}") from None
    if pending:
        late = [f"engine {i} ({engines[i]})" for i, r in enumerate(refs) if r in pending]
        raise TimeoutError(f"weight sync: {', '.join(late)} did not finish {what} within "
                           f"{timeout_s}s (trainer.weight_sync_timeout_s); the trainer ranks are "
                           "now out of step, restart the run")
    return actors.get(refs)


def _dead(refs: list, engines: list, wait_s: float = 5.0) -> str:
    """" (engine i died)" if one of `refs`' engines is dead, else "" (after at most wait_s)."""
    actors.wait(refs, num_returns=len(refs), timeout=wait_s)
    for i, r in enumerate(refs):
        try:
            actors.get(r, timeout=0)
        except ray.exceptions.RayActorError:
            return f" (engine {i} ({engines[i]}) died)"
        except Exception:
            pass
    return ""


class WeightGroup:
    """One member of the weight-sync group (rank 0 sends, the others receive), rendezvous at the
    TCPStore on host:port (rank 0 passes the store it serves)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str,
                 timeout_s: float, store: Any = None) -> None:
        self.rank, self.backend, self.timeout_s = rank, backend, timeout_s
        timeout = timedelta(seconds=timeout_s)
        store = dist.PrefixStore("molt-weight-sync", store if store is not None else
                                 dist.TCPStore(host, port, world_size, False, timeout=timeout))
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            own = host if host == "127.0.0.1" or rank == 0 else ray.util.get_node_ip_address()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=own)]
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            raise ValueError(f"weight-sync backend '{backend}' unknown; valid: gloo, nccl")
        self.device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                       else torch.device("cpu"))

    def broadcast(self, flat: torch.Tensor, what: str = "weights") -> torch.Tensor:
        """Rank 0's `flat` [bytes] into every rank's `flat`, or an error within the timeout."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, timedelta(seconds=self.timeout_s)
        work = self.pg.broadcast([flat], opts)
        if self.backend == "gloo":
            work.wait(timedelta(seconds=self.timeout_s))
            return flat
        deadline = time.monotonic() + self.timeout_s     # NCCL: wait() only syncs streams
        while not work.is_completed():
            if time.monotonic() > deadline:
                self.pg.abort()
                raise TimeoutError(f"weight-sync broadcast of {what} did not finish within "
                                   f"{self.timeout_s}s (trainer.weight_sync_timeout_s)")
            time.sleep(0.001)
        work.wait()
        return flat

    def receive(self, metas: list[Meta]) -> list[tuple[str, torch.Tensor]]:
        """Receive one bucket described by `metas`; tensors view one buffer."""
        flat = torch.empty(_nbytes(metas), dtype=torch.uint8, device=self.device)
        return unpack(self.broadcast(flat), metas)


class ShmChannel:
    """Trainer rank 0's end of the `shm` transport: two slots (shared-memory files, mapped here
    and by the engines), each grown to the largest bucket it has held."""

    def __init__(self) -> None:
        self.slots: list[tuple[str, torch.Tensor] | None] = [None, None]
        self.loading: list[list] = [[], []]       # engines' receive_shm calls per slot
        self.linked: list[str] = []               # files no engine has mapped yet

    def fill(self, slot: int, named: list[tuple[str, torch.Tensor]]) -> tuple[str, list[Meta], int]:
        """Pack `named` into `slot`; returns the file, the metadata and the file's size."""
        metas = _metas(named)
        need = _nbytes(metas)
        if self.slots[slot] is None or self.slots[slot][1].numel() < need:
            if self.slots[slot] is not None:         # its buckets are loaded: it was mapped
                self.unlink(self.slots[slot][0])
            path = os.path.join(_SHM, f"molt-weights-{uuid.uuid4().hex}")
            with open(path, "wb") as f:
                f.truncate(need)
            self.slots[slot] = (path, torch.from_file(path, shared=True, size=need,
                                                      dtype=torch.uint8))
            self.linked.append(path)
        path, buf = self.slots[slot]
        pack(named, buf, metas)
        return path, metas, buf.numel()

    def unlink(self, only: str | None = None) -> None:
        """Remove the files' names (the mappings stay) once every engine has mapped them."""
        for path in [p for p in self.linked if only in (None, p)]:
            os.unlink(path)
            self.linked.remove(path)

    def __del__(self) -> None:
        self.unlink()


def _metas(named: list[tuple[str, torch.Tensor]]) -> list[Meta]:
    metas, off = [], 0
    for name, t in named:
        metas.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), off))
        off += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return metas


def pack(named: list[tuple[str, torch.Tensor]], flat: torch.Tensor | None = None,
         metas: list[Meta] | None = None) -> tuple[list[Meta], torch.Tensor]:
    """(metadata, one uint8 buffer: `flat` or new), each tensor at a 64-byte aligned offset."""
    metas = metas or _metas(named)
    if flat is None:
        flat = torch.empty(_nbytes(metas), dtype=torch.uint8,
                           device=named[0][1].device if named else "cpu")
    for (_, _, _, o), (_, t) in zip(metas, named):
        n = t.numel() * t.element_size()
        flat[o:o + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
    return metas, flat


def unpack(flat: torch.Tensor, metas: list[Meta]) -> list[tuple[str, torch.Tensor]]:
    """Views of `flat` [bytes] as the tensors `metas` describe (no copy)."""
    return [(name, flat[off:off + nbytes(dt, shape)].view(getattr(torch, dt)).view(shape))
            for name, dt, shape, off in metas]


def checksums(named: list[tuple[str, torch.Tensor]]) -> list[int]:
    """Per tensor: its bytes as int64 words (and the tail bytes) summed modulo 2**64, exact on
    any device and in any reduction order; one pass over memory, one device sync."""
    out = []
    for _, t in named:
        b = t.detach().reshape(-1).view(torch.uint8)
        b, n = b if b.storage_offset() % 8 == 0 else b.clone(), len(b) // 8 * 8
        s = (b if n == len(b) else b[:n]).view(torch.int64).sum()
        out.append(s if n == len(b) else s + b[n:].sum())
    return torch.stack(out).tolist() if out else []


def nbytes(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * getattr(torch, dtype).itemsize


def _nbytes(metas: list[Meta]) -> int:
    return max([off + -(-nbytes(dt, shape) // _ALIGN) * _ALIGN for _, dt, shape, off in metas]
               + [_ALIGN])
