"""Weights from the trainer into a running vLLM server over a process group of their own; torch only here.

``CollectiveSync`` is the trainer's side of ``vllm_worker.WeightReceiver`` (loaded into the server with
``--worker-extension-cls``, driven through ``/collective_rpc``): it hosts a TCP store, joins the server's
workers into one group (gloo on CPU, NCCL on GPU: the only difference between the two), and per sync
broadcasts the weights as flat buckets of consecutive same-dtype tensors, in the served dtypes, while the
workers stream them into vLLM's in-place reload. Each bucket is built from the policy's ``WeightStream`` as the
export produces it, on the policy's device: no copy of the whole model is held anywhere, and a GPU's tensors
never pass through host memory. Nothing of vLLM is imported in the trainer.

Before anything is sent, the tensors are checked against the served names and shapes (``FolderSync.check``).
A transfer that fails (a worker refuses, the group times out) is redone through the folder path with the same
tensors, so the server never keeps a half-received model; if that fails too, the server's state is unknown and
``GeneratorUnavailable`` says to restart it. The group is rebuilt at the next sync.

Many engines (`vllm_engines.EnginePool`): one group joins this process and every worker of every live engine
(world ``1 + sum of the engines' TP sizes``, `group_ranks`), each bucket is broadcast once to all of them, and the
group is rebuilt when an engine is lost.
"""

from __future__ import annotations

import math
import socket
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, Iterable

import torch

from nemo_rcgrpo.generation.vllm_client import GeneratorError, GeneratorUnavailable, VLLMClient, WeightSyncError
from nemo_rcgrpo.generation.vllm_sync import engines_of, fan_out, paused
from nemo_rcgrpo.generation.vllm_worker import broadcast, make_group, versions
from nemo_rcgrpo.utils.weight_stream import WeightStream, nbytes
from nemo_rcgrpo.utils.weight_stream import plan_buckets as buckets_of

EXTENSION = "nemo_rcgrpo.generation.vllm_worker.WeightReceiver"
BUCKET_BYTES = 256 << 20  # per broadcast


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_buckets(
    meta: list[tuple[str, tuple[int, ...], str]], bucket_bytes: int = BUCKET_BYTES
) -> list[tuple[int, int]]:
    """[start, end) ranges over ``meta`` ([name, shape, dtype name] in send order): consecutive tensors of one
    dtype, up to ``bucket_bytes`` each (a larger tensor is a bucket of its own)."""
    return buckets_of([(nbytes(shape, getattr(torch, dtype)), dtype) for _, shape, dtype in meta], bucket_bytes)


def nccl_mismatch(ours: str | None, theirs: list) -> str | None:
    """Why an NCCL group between this process (NCCL ``ours``) and the workers (their ``versions()``) must not be
    built, or None: NCCL needs one release (major.minor) on every rank of a communicator."""
    release = lambda v: ".".join(str(v).split(".")[:2]) if v else None  # noqa: E731
    found = sorted({str(t.get("nccl")) for t in theirs if isinstance(t, dict)})
    if ours is None or not found or any(release(v) != release(ours) for v in found):
        return f"NCCL {ours} in the trainer and {', '.join(found) or 'unknown'} in the vLLM server's workers"
    return None


class CollectiveSync:
    """Trainer side of the collective weight transfer (the module docstring; a `generation.base.WeightSync`)."""

    def __init__(
        self,
        client: VLLMClient,
        master: str | None,
        timeout: float,
        fallback,
        backend: str | None = None,
        default_dtype: torch.dtype = torch.float32,
        bucket_bytes: int = BUCKET_BYTES,
        verify: bool = False,
    ):
        """``fallback``: the ``FolderSync`` of the same server (its manifest, when known, gives the served names,
        shapes and dtypes the tensors are checked against and sent in; else floating tensors go as
        ``default_dtype``). ``verify``: every worker returns each received tensor's float64 sum, compared with the
        sent tensor's (a pass over the weights on both sides; for tests and debugging)."""
        self.client, self.master, self.timeout = client, master, timeout
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise WeightSyncError("generation.vllm.weight_sync=nccl needs CUDA here; use auto (gloo on CPU) or folder")
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        )
        self.fallback, self.default_dtype, self.bucket_bytes, self.verify = (
            fallback,
            default_dtype,
            bucket_bytes,
            verify,
        )
        self.dtypes: dict[str, torch.dtype] = {}
        self.disabled: str | None = None  # why every sync goes through folders instead (said once)
        self.group = self.store = None
        self.members: tuple = ()  # the engines' clients the group was built with (rebuilt when they change)
        self.world_size = 0
        self.stats: dict[str, float] = {"syncs": 0, "broadcasts": 0, "bytes": 0, "fallbacks": 0}
        self.version = fallback.version  # of the weights the workers hold (set once a push has finished)

    # ------------------------------------------------------------------ group
    def _rpc(self, client: VLLMClient, method: str, kwargs: dict[str, Any], box: dict) -> None:
        try:
            box["result"] = client.collective_rpc(method, kwargs, self.timeout)
        except BaseException as e:  # noqa: BLE001 - reported by the caller's thread
            box["error"] = e

    def _join(self) -> None:
        from nemo_rcgrpo.utils.dist import free_port

        clients = engines_of(self.client)
        if self.backend == "nccl":
            answers = fan_out(clients, lambda c: c.collective_rpc("rcgrpo_versions", {}, self.timeout))
            theirs = [r for a in answers for r in (a or {}).get("results", [])]
            why = nccl_mismatch(versions()["nccl"], theirs)
            if why:
                self.disabled = f"{why}: one communicator cannot join them; weights go through folders"
                raise WeightSyncError(self.disabled)
        sizes = [int(c._call("GET", "/get_world_size", params={"include_dp": "false"})["world_size"]) for c in clients]
        offsets = group_ranks(sizes)  # engine i's workers are ranks 1 + offsets[i] + their rank in the engine
        world = 1 + sum(sizes)
        host, _, port = (self.master or "").partition(":")
        host = host or (
            "127.0.0.1"
            if self.backend == "gloo" and all(c.url.startswith("http://127.") for c in clients)
            else socket.gethostbyname(socket.gethostname())
        )
        port = int(port) if port else free_port("")
        group = f"rcgrpo-{uuid.uuid4().hex[:8]}"
        join = {"host": host, "port": port, "world_size": world, "backend": self.backend, "group": group}
        # rank_offset only where it is not 0: a single engine's worker extension of an older release joins as before
        kwargs = [{**join, "timeout_s": self.timeout, **({"rank_offset": o} if o else {})} for o in offsets]
        boxes = self._rpcs(clients, "rcgrpo_join", kwargs)
        try:
            self.store, self.group = make_group(host, port, 0, world, self.backend, group, self.timeout)
        finally:
            for rpc, _ in boxes:
                rpc.join(self.timeout + 60)
        if any("error" in box or rpc.is_alive() for rpc, box in boxes):
            self.group = self.store = None
            error = next((box["error"] for _, box in boxes if "error" in box), "no answer")
            raise WeightSyncError(
                f"the server's workers did not join the weight transfer ({error}); serve with "
                f"--worker-extension-cls {EXTENSION} (`rcgrpo serve` and managed servers do)"
            )
        self.members, self.world_size = tuple(clients), world

    def _rpcs(self, clients: list, method: str, kwargs: list[dict[str, Any]]) -> list[tuple[threading.Thread, dict]]:
        """``method`` on every engine's workers at once, each in a thread of its own (they block in the group's
        collectives until this process joins them); (thread, its answer box) per engine."""
        out = []
        for client, kw in zip(clients, kwargs):
            box: dict = {}
            rpc = threading.Thread(target=self._rpc, args=(client, method, kw, box), daemon=True)
            rpc.start()
            out.append((rpc, box))
        return out

    # ------------------------------------------------------------------ sync
    def push(self, weights: Iterable[tuple[str, torch.Tensor]] | WeightStream | Path, version: int) -> None:
        """``weights``: a ``WeightStream`` (read bucket by bucket as it is produced; read a second time only if
        the transfer fails and is redone through a folder), a folder, or tensors already held."""
        self._push(weights, version)
        self.version = version

    def _push(self, weights: Iterable[tuple[str, torch.Tensor]] | WeightStream | Path, version: int) -> None:
        if isinstance(weights, (str, Path)):  # a folder: the folder path loads it
            self.fallback.push(weights, version)
            return
        stream = weights if isinstance(weights, WeightStream) else WeightStream.of(weights)
        self.fallback.check_meta(stream.meta)  # names and shapes against the served model, or refused
        if self.disabled:
            self.fallback.push(stream, version)
            return
        manifest = self.fallback.manifest or {}
        self.dtypes = {
            n: manifest[n][1] if n in manifest else (self.default_dtype if d.is_floating_point else d)
            for n, _, d in stream.meta
        }
        failed = None
        with paused(engines_of(self.client)):
            try:
                self._send(stream)
            except GeneratorUnavailable:
                raise
            except (GeneratorError, RuntimeError) as e:  # not ValueError: an export unlike its announcement is a bug
                failed = e
        if failed is not None:  # the workers may hold part of the new weights: load all of them from a folder
            self.group = self.store = None  # rebuilt at the next sync
            self.stats["fallbacks"] += 1
            print(
                f"warning: the collective weight transfer of version {version} failed ({failed}); "
                f"sending it through a folder",
                file=sys.stderr,
                flush=True,
            )
            try:
                self.fallback.push(stream, version)  # a second pass over the export
            except GeneratorError as again:
                raise GeneratorUnavailable(
                    f"weight update to version {version} failed through the process group "
                    f"({failed}) and through a folder ({again}); what the server holds is "
                    f"unknown: restart it"
                ) from None
            return
        if self.fallback.manifest is None:  # an attached server: what was sent is what it serves now
            self.fallback.manifest = {n: (tuple(shape), self.dtypes[n]) for n, shape, _ in stream.meta}

    def _send(self, stream: WeightStream) -> None:
        """One pass over ``stream``: each bucket is built from the tensors as they come and broadcast once to every
        engine's workers (the bytes this process hands the group do not depend on the number of engines)."""
        clients = engines_of(self.client)
        if self.group is None or self.members != tuple(clients):  # first sync, or an engine was lost since
            self.group = self.store = None
            self._join()
        meta = [(name, tuple(int(d) for d in shape), dtype_name(self.dtypes[name])) for name, shape, _ in stream.meta]
        buckets = plan_buckets(meta, self.bucket_bytes)
        receive = {
            "meta": [[n, list(s), d] for n, s, d in meta],
            "buckets": [list(b) for b in buckets],
            "timeout_s": self.timeout,
            "verify": self.verify,
        }
        rpcs = self._rpcs(clients, "rcgrpo_receive", [receive] * len(clients))
        sums = []
        tensors = iter(stream)
        try:
            for start, end in buckets:
                if any("error" in box for _, box in rpcs):
                    break
                dtype = self.dtypes[meta[start][0]]
                parts = [next(tensors)[1].detach().to(self.device, dtype).reshape(-1) for _ in range(start, end)]
                if self.verify:
                    sums += [float(x.double().sum()) for x in parts]
                flat = torch.cat(parts) if len(parts) > 1 else parts[0]
                del parts
                broadcast(self.group, flat, self.timeout)
                self.stats["broadcasts"] += 1
                self.stats["bytes"] += flat.numel() * flat.element_size()
        finally:
            for rpc, _ in rpcs:
                rpc.join(self.timeout + 60)
        gone = next((box["error"] for _, box in rpcs if isinstance(box.get("error"), GeneratorUnavailable)), None)
        if gone is not None:  # an engine is gone: the caller drops it and sends again, not a folder fallback
            raise gone
        for rpc, box in rpcs:
            if "error" in box:
                raise box["error"] if isinstance(box["error"], GeneratorError) else GeneratorError(str(box["error"]))
            if rpc.is_alive():
                raise GeneratorError("the server's workers did not finish receiving the weights")
        results = []  # one per worker of every engine
        for _, box in rpcs:
            answer = box.get("result")
            results += (answer.get("results") if isinstance(answer, dict) else None) or [None]
        counts = [r.get("tensors") if isinstance(r, dict) else r for r in results]
        if len(counts) != self.world_size - 1 or any(c != len(meta) for c in counts):
            raise GeneratorError(f"workers received {counts} tensors of {len(meta)}")
        if self.verify and any(
            len(r["sums"]) != len(sums)
            or not all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9) for a, b in zip(r["sums"], sums))
            for r in results
        ):
            raise GeneratorError("the tensors a worker received differ from the tensors sent")
        self.stats["syncs"] += 1

    def close(self) -> None:
        self.group = self.store = None


def group_ranks(sizes: list[int]) -> list[int]:
    """Each engine's rank offset in the transfer group: the trainer is rank 0, then engine 0's ``sizes[0]`` workers
    (its TP ranks), engine 1's, ...: worker r of engine i is rank ``1 + offsets[i] + r``, of a world of
    ``1 + sum(sizes)``."""
    return [sum(sizes[:i]) for i in range(len(sizes))]
