"""Image bytes travel to workers in POSIX shared memory, beside the message, not in it.

One segment per image, named after this daemon's pid. Its space is reserved before a
byte is written (a full /dev/shm is then an error for that request, never a SIGBUS in
the supervisor). The worker unlinks it as soon as it has opened it, so that it outlives
no one; the supervisor unlinks what a worker never opened when the job leaves it, and
stale ones of dead daemons are removed at start.
"""

from __future__ import annotations

import contextlib
import itertools
import os

from modelpool.protocol.kinds import Kind
from modelpool.protocol.messages import ImageInput, WorkRequest
from modelpool.protocol.pipes import SHM_DIR, SharedBytes, WorkItem

PREFIX = "modelpool-"


def segment_prefix(pid: int | None = None) -> str:
    """How the names of a daemon's segments start (default: this process's): by its pid,
    so that a later daemon can tell a dead one's stale segments."""
    return f"{PREFIX}{os.getpid() if pid is None else pid}-"


class NoSharedMemory(Exception):
    """No room in /dev/shm for a request's images (it is for that request only)."""


class SharedImages:
    def __init__(self) -> None:
        self.by_job: dict[int, list[str]] = {}
        self._ids = itertools.count()
        self._prefix = segment_prefix()

    def work_item(self, job_id: int, kind: Kind, request: WorkRequest) -> WorkItem:
        """The work item for a job, its image bytes moved into shared memory;
        NoSharedMemory (nothing left behind) when they do not fit."""
        if kind.with_images is None:  # most requests
            return WorkItem(job_id=job_id, request=request)
        inputs = kind.images(request)
        if not any(i.data for i in inputs):
            return WorkItem(job_id=job_id, request=request)
        refs: list[SharedBytes | None] = []
        names = self.by_job.setdefault(job_id, [])
        try:
            for image in inputs:
                if image.data:
                    names.append(self._write(image.data))
                    refs.append(SharedBytes(names[-1], len(image.data)))
                else:
                    refs.append(None)
        except NoSharedMemory:
            self.release(job_id)
            raise
        stripped = [ImageInput(url=i.url) for i in inputs]
        return WorkItem(job_id=job_id, request=kind.with_images(request, stripped), shared=refs)

    def release(self, job_id: int) -> None:
        names = self.by_job.pop(job_id, None)
        if not names:
            return  # most jobs: no images, and this runs for every reply
        import _posixshmem

        for name in names:
            with contextlib.suppress(FileNotFoundError):
                _posixshmem.shm_unlink("/" + name)

    def release_all(self) -> None:
        for job_id in list(self.by_job):
            self.release(job_id)

    def _write(self, data: bytes) -> str:
        import _posixshmem  # SharedMemory would also register a resource tracker we avoid

        name = f"{self._prefix}{next(self._ids)}"
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, len(data))  # the pages exist now: no SIGBUS later
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as exc:
            _posixshmem.shm_unlink("/" + name)
            raise NoSharedMemory(f"no room in {SHM_DIR} for {len(data)} bytes of image data "
                                 f"({exc.strerror}); it frees as other images are done") from None
        finally:
            os.close(fd)
        return name


def weights_segment(worker_id: int) -> str:
    """Where a weights holder puts CPU weights: named like the image segments, so the
    stale ones of a dead daemon are removed the same way."""
    return f"{segment_prefix()}weights-{worker_id}"


def unlink_segment(name: str) -> None:
    (SHM_DIR / name).unlink(missing_ok=True)


def remove_stale_segments() -> int:
    """Segments left by daemons that died without cleaning up."""
    removed = 0
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
