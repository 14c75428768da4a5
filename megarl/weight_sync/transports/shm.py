"""``shm``: each bucket as a safetensors file in the run's private staging folder; engines on
this host stage them by path (``/weights/load``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from megarl.distributed import ParallelDims
from megarl.fleet.protocol import Replay, WeightUpdateProtocol
from megarl.weight_sync.transports.base import Bucket, FleetPhases


class ShmTransport(FleetPhases):
    """Each stage owner writes its buckets as safetensors files under ``root`` (/dev/shm):
    one memcpy, no RPC per tensor; engines on this host read them. The last committed
    version's files stay until the next commit, so a restarted engine can replay them."""

    name = "shm"
    device = "cpu"
    send_needs_begin = False  # files in the staging folder: the engines read them at load
    updates_joining_engines = True

    def __init__(self, fleet: WeightUpdateProtocol | None, dims: ParallelDims, root: Path) -> None:
        self.fleet, self.dims, self.root = fleet, dims, root
        self._files: list[str] = []
        self._prev_dir: Path | None = None
        self._committed = False
        """The load request committed too (a fleet of one engine)."""

    def begin(self, version: int) -> None:
        """Nothing to open before the files are written: the load request opens the update."""
        if self.fleet is not None:
            self.fleet.open_update(version, begin=False)

    def send(self, version: int, buckets: list[Bucket]) -> list[str]:
        from safetensors.torch import save_file

        files = []
        vdir = self.root / f"v{version}"
        if buckets:
            vdir.mkdir(parents=True, exist_ok=True)
        for k, bucket in enumerate(buckets):
            path = vdir / f"stage{self.dims.pp_rank}_bucket{k}.safetensors"
            save_file(dict(bucket), str(path))
            files.append(str(path))
        return files

    def load(self, version: int, receipts: list[Any]) -> None:
        self._files = [f for files in receipts for f in files]
        self._committed = False
        if self.fleet is not None:
            one = len(self.fleet.members()) == 1
            self._committed = self.fleet.load_files(version, self._files, begin=True, commit=one)

    def commit(self, version: int) -> None:
        """The engines apply what they staged (with one engine its load request did)."""
        if self.fleet is not None:
            self.fleet.close_update(version, self.replay(version), commit=not self._committed)

    def replay(self, version: int) -> Replay:
        fleet, files = self.fleet, list(self._files)
        assert fleet is not None
        return lambda engines: fleet.update_engines(engines, version, files)

    def release(self, version: int, committed: bool) -> None:
        vdir = self.root / f"v{version}"
        if not committed:
            shutil.rmtree(vdir, ignore_errors=True)
            return
        if self._prev_dir is not None and self._prev_dir != vdir:
            shutil.rmtree(self._prev_dir, ignore_errors=True)
        self._prev_dir = vdir
