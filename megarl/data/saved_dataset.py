"""Read a folder written by HF ``datasets``' ``save_to_disk`` (how users keep their data),
with pyarrow alone: megarl does not need ``datasets`` installed to train on it.

A ``Dataset`` folder holds ``state.json`` (its Arrow files, in order) and those files in
Arrow's streaming format; a ``DatasetDict`` folder holds ``dataset_dict.json`` and one such
folder per split, of which the ``train`` split is read. Rows come back as plain dicts named
``'<folder>:row <i>'`` for error messages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megarl.errors import DataError


def read_saved_dataset(folder: Path, split: str = "train") -> list[tuple[str, dict[str, Any]]]:
    """(where, row) pairs of a ``save_to_disk`` folder (a ``DatasetDict``: its ``split``)."""
    import pyarrow as pa

    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise DataError(f"{folder}: DatasetDict has splits {splits}, no '{split}' split to train on")
        folder = folder / split
    state = folder / "state.json"
    if not state.is_file():
        raise DataError(f"{folder}: a data folder must be written by datasets' save_to_disk (state.json is missing)")
    files = [folder / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    if not files:
        raise DataError(f"{state}: lists no Arrow data files")
    out: list[tuple[str, dict[str, Any]]] = []
    for path in files:
        if not path.is_file():
            raise DataError(f"{state} lists {path.name}, which does not exist")
        with pa.memory_map(str(path)) as src:
            table = pa.ipc.open_stream(src).read_all()
        out.extend((f"{folder}:row {i}", row) for i, row in enumerate(table.to_pylist(), start=len(out)))
    return out
