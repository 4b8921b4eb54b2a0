"""Weights held once per model by a holder process and mapped by every serving worker.

The holder is a worker process that loads the model with the model's own loader, shares
its tensors and never serves, so no serving worker owns memory a sibling reads: workers
can be evicted, scaled down or killed at any time.

- CPU: the holder copies every storage into one POSIX shared-memory segment and then
  uses that copy itself. Workers map the segment privately (copy-on-write: a worker that
  wrote to a weight would get its own page and never change a sibling's). A mapping
  outlives the unlinking of its segment, so no worker reads freed memory even if the
  holder dies.
- CUDA: the holder exports each storage with CUDA IPC (torch's `_share_cuda_`). That
  memory is valid only while the holder lives, so the supervisor stops a model's workers
  before its holder and replaces them all if the holder dies.

A worker runs the same loader (on the CPU, where file-backed weights cost nothing) and
then swaps every parameter and buffer for the holder's; the two must match exactly.
Tied weights share one storage in the holder, so they stay tied in the workers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from modelpool.protocol.pipes import SHM_DIR, CpuStorage, CudaStorage, SharedTensor, SharedWeights

ALIGN = 64  # every storage starts aligned, so any dtype's view of it is too


def torch_modules(model: object) -> dict[str, nn.Module]:
    """The modules a loaded model object holds: itself, its attributes that are modules,
    and the module components of a pipeline attribute (diffusers)."""
    if isinstance(model, nn.Module):
        return {"": model}
    found: dict[str, nn.Module] = {}
    for name, value in sorted(vars(model).items()):
        if isinstance(value, nn.Module):
            found[name] = value
        elif isinstance(getattr(value, "components", None), dict):
            for part, module in sorted(value.components.items()):
                if isinstance(module, nn.Module):
                    found[f"{name}.{part}"] = module
    return found


def _tensors(model: object) -> Iterator[tuple[str, bool, nn.Module, str, torch.Tensor]]:
    """(path, is buffer, top module, dotted name, tensor) of every parameter and buffer,
    tied ones under each of their names."""
    for module_name, module in torch_modules(model).items():
        for name, param in module.named_parameters(remove_duplicate=False):
            yield f"{module_name}/{name}", False, module, name, param
        for name, buf in module.named_buffers(remove_duplicate=False):
            yield f"{module_name}/{name}", True, module, name, buf


def _replace(module: nn.Module, dotted: str, tensor: torch.Tensor, buffer: bool) -> None:
    owner_path, _, leaf = dotted.rpartition(".")
    owner = module.get_submodule(owner_path)
    if buffer:
        owner._buffers[leaf] = tensor
    else:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"shared weights: unknown dtype {name!r}")
    return dtype


def export(model: object, segment: str) -> SharedWeights:
    """In the holder: share every tensor of the model (CPU: through `segment`)."""
    entries = list(_tensors(model))
    if not entries:
        raise ValueError("shared weights: the loaded model holds no torch modules")
    index: dict[int, int] = {}
    storages: list[torch.UntypedStorage] = []
    tensors = []
    for path, buffer, _, _, tensor in entries:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in index:
            index[key] = len(storages)
            storages.append(storage)
        tensors.append(SharedTensor(path, buffer, index[key], tensor.storage_offset(),
                                    list(tensor.shape), list(tensor.stride()),
                                    str(tensor.dtype).removeprefix("torch.")))
    if storages[0].device.type == "cuda":
        handles = [CudaStorage(*s._share_cuda_()) for s in storages]
        return SharedWeights(storages=handles, tensors=tensors)
    return _export_cpu(model, segment, storages, tensors)


def _export_cpu(model: object, segment: str, storages: list[torch.UntypedStorage],
                tensors: list[SharedTensor]) -> SharedWeights:
    layout, cursor = [], 0
    for storage in storages:
        layout.append(CpuStorage(cursor, storage.nbytes()))
        cursor += -(-storage.nbytes() // ALIGN) * ALIGN
    path = SHM_DIR / segment
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(cursor, 1))
    finally:
        os.close(fd)
    mapping = torch.from_file(str(path), shared=True, size=max(cursor, 1), dtype=torch.uint8)
    for storage, place in zip(storages, layout, strict=True):
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        mapping[place.offset_bytes:place.offset_bytes + place.nbytes].copy_(raw)
    shared = SharedWeights(segment=segment, segment_bytes=max(cursor, 1),
                           storages=layout, tensors=tensors)
    _swap(model, shared, [mapping.untyped_storage()] * len(layout))  # the copy is ours now
    return shared


def attach(model: object, shared: SharedWeights, device: torch.device) -> None:
    """In a serving worker: replace every tensor of the freshly loaded model by the
    holder's. Raises ValueError if the two models differ in any tensor."""
    if shared.segment is not None:
        mapping = torch.from_file(str(SHM_DIR / shared.segment), shared=False,
                                  size=shared.segment_bytes, dtype=torch.uint8)
        opened = [mapping.untyped_storage()] * len(shared.storages)
    else:
        torch.cuda._lazy_init()
        opened = [_open_cuda(s) for s in shared.storages]
    _swap(model, shared, opened)
    stray = [path for path, _, _, _, t in _tensors(model) if t.device != device]
    if stray:
        raise ValueError(f"shared weights: {len(stray)} tensors not on {device}: {stray[:3]}")


def _open_cuda(storage: CpuStorage | CudaStorage) -> torch.UntypedStorage:
    if not isinstance(storage, CudaStorage):
        raise ValueError("shared weights: a CPU storage in a CUDA model's weights")
    return torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
        storage.device, storage.handle, storage.size_bytes, storage.offset_bytes,
        storage.ref_counter_handle, storage.ref_counter_offset, storage.event_handle,
        storage.event_sync_required)


def _swap(model: object, shared: SharedWeights, opened: list[Any]) -> None:
    by_path = {t.path: t for t in shared.tensors}
    entries = list(_tensors(model))
    ours = {path for path, *_ in entries}
    if ours != by_path.keys():
        missing, extra = sorted(by_path.keys() - ours), sorted(ours - by_path.keys())
        raise ValueError(f"shared weights do not match this model: holder only "
                         f"{missing[:3]}, worker only {extra[:3]}")
    for path, buffer, module, name, mine in entries:
        spec = by_path[path]
        if list(mine.shape) != spec.shape or str(mine.dtype).removeprefix("torch.") != spec.dtype:
            raise ValueError(f"shared weights: {path} is {list(mine.shape)} {mine.dtype} here, "
                             f"{spec.shape} {spec.dtype} in the holder")
        tensor = _view(opened[spec.storage], shared.storages[spec.storage], spec)
        _replace(module, name, tensor, buffer)


def _view(storage: torch.UntypedStorage, where: CpuStorage | CudaStorage,
          spec: SharedTensor) -> torch.Tensor:
    dtype = _dtype(spec.dtype)
    base = where.offset_bytes if isinstance(where, CpuStorage) else 0
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=storage.device).set_(
        storage, base // itemsize + spec.offset, spec.shape, spec.stride)
