"""Host storage for the layer inputs that activation checkpointing keeps (docs/memory.md "Offload").

``HostStore.put(tensors)`` keeps the newest entry on its device and moves the one before it to host
buffers; ``take(handle)`` returns an entry's tensors on their device again. Layers are checkpointed
in forward order and taken back in reverse order, so:

* the last layer's input never leaves the device (the first backward step does not wait for a copy);
* when layer i is taken back, layer i-1's copy to the device starts (a prefetch).

On CUDA the host buffers are pinned and pooled (reused across layers and steps), both directions
copy on a side stream, and the compute stream waits on an event only where it reads the data. On
CPU the same code runs with plain pooled buffers (the "device" is the host: nothing is saved, the
code path is exercised).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PoolKey = tuple[tuple[int, ...], torch.dtype]


@dataclass(eq=False)
class Handle:
    """One checkpoint's saved tensors: on their device (``device``) or in host buffers (``host``)."""

    device: list[torch.Tensor] | None
    host: list[torch.Tensor] | None = None
    ready: torch.cuda.Event | None = None  # host copy done (D2H) or device copy done (H2D)
    devices: list[torch.device] = field(default_factory=list)
    bytes: int = 0


class HostStore:
    """Where checkpointed layer inputs live between forward and backward (one per model).

    Args:
        offload: move all but the newest entry to host memory; False keeps everything where it is.
    """

    def __init__(self, offload: bool) -> None:
        self.offload = offload
        self._pool: dict[PoolKey, list[torch.Tensor]] = {}
        self._order: list[Handle] = []  # entries not yet taken back, in forward order
        self._stream: torch.cuda.Stream | None = None
        self.host_bytes = 0  # bytes in host buffers right now
        self.peak_host_bytes = 0

    def reset_peak(self) -> None:
        self.peak_host_bytes = self.host_bytes

    # -------------------------------------------------------------- forward
    def put(self, tensors: list[torch.Tensor]) -> Handle:
        """Keep ``tensors`` (detached); the previous entry moves to host memory when offloading."""
        handle = Handle([t.detach() for t in tensors], devices=[t.device for t in tensors])
        handle.bytes = sum(t.numel() * t.element_size() for t in tensors)
        if self.offload:
            if self._order and self._order[-1].device is not None:
                self._to_host(self._order[-1])
            self._order.append(handle)
        return handle

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        key = (tuple(like.shape), like.dtype)
        free = self._pool.get(key)
        if free:
            return free.pop()
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)

    def _to_host(self, handle: Handle) -> None:
        tensors = handle.device
        assert tensors is not None
        host = [self._buffer(t) for t in tensors]
        if any(t.is_cuda for t in tensors):
            stream = self._side_stream(tensors[0].device)
            stream.wait_stream(torch.cuda.current_stream(tensors[0].device))
            with torch.cuda.stream(stream):
                for src, dst in zip(tensors, host):
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(stream)  # the allocator keeps src until the copy is done
                handle.ready = torch.cuda.Event()
                handle.ready.record(stream)
        else:
            for src, dst in zip(tensors, host):
                dst.copy_(src)
        handle.host, handle.device = host, None
        self.host_bytes += handle.bytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    # -------------------------------------------------------------- backward
    def take(self, handle: Handle) -> list[torch.Tensor]:
        """The entry's tensors on their devices; starts bringing back the entry before it."""
        if handle in self._order:
            at = self._order.index(handle)
            self._order.pop(at)
            if at > 0:
                self._to_device(self._order[at - 1])  # the next one backward needs
        if handle.device is None:
            self._to_device(handle)
        if handle.ready is not None:
            torch.cuda.current_stream(handle.device[0].device).wait_event(handle.ready)
            handle.ready = None
        return handle.device

    def _to_device(self, handle: Handle) -> None:
        if handle.device is not None or handle.host is None:
            return
        if any(d.type == "cuda" for d in handle.devices):
            stream = self._side_stream(handle.devices[0])
            with torch.cuda.stream(stream):
                # allocated on the side stream; the compute stream waits on ``ready`` before reading
                handle.device = [h.to(d, non_blocking=True) for h, d in zip(handle.host, handle.devices)]
                handle.ready = torch.cuda.Event()
                handle.ready.record(stream)
            for t in handle.device:
                t.record_stream(torch.cuda.current_stream(t.device))
        else:
            handle.device = list(handle.host)  # host memory is the device: hand the buffers out

    def release(self, handle: Handle) -> None:
        """Backward is done with the entry: its host buffers go back to the pool."""
        if handle in self._order:
            self._order.remove(handle)
        if handle.host is not None:
            if handle.ready is not None:
                handle.ready.synchronize()
            for buf in handle.host:
                self._pool.setdefault((tuple(buf.shape), buf.dtype), []).append(buf)
            self.host_bytes -= handle.bytes
            handle.host = None
        handle.device = None

    def clear(self) -> None:
        """Forget entries of a forward whose backward never ran, and the pooled buffers."""
        for handle in list(self._order):
            self.release(handle)
        self._pool.clear()
