"""A new source type in one file: a folder of ``.npy`` files, one sample per file.

Nothing in the engine changes for it. A map-style source needs ``__len__`` and
``__getitem__`` (:class:`meshfeed.protocols.Source`); two optional methods make it better:

- ``fetch_batch(indices)`` returns the collated batch in one call (it must equal
  ``default_collate([source[i] for i in indices])``; :class:`~meshfeed.protocols.BatchSource`);
- ``fingerprint`` identifies the data in checkpoints, so a state is never resumed on another
  folder (:class:`~meshfeed.protocols.FingerprintedSource`).

A file that cannot be read is a damaged file, not a bad sample: it raises
:class:`meshfeed.errors.SourceError` naming the file, which the loader never substitutes.
The object is small and picklable (it holds file names, not data), so it works unchanged with
worker processes (``num_workers=``), torchrun / gloo ranks (each rank reads only its slice),
Ray (``service=RayService()`` with ``functools.partial(NpyFolder, path)``) and exact resume
(``state_dict`` / ``load_state_dict``).

Run:  PYTHONPATH=src python examples/npy_folder_source.py
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile

import numpy as np
import torch

from meshfeed.errors import SourceError

__all__ = ["NpyFolder", "write_npy_folder"]


class NpyFolder:
    """Sample ``i`` is the ``i``-th ``.npy`` file of ``folder`` in name order (equal shapes)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = pathlib.Path(folder)
        if not self.folder.is_dir():
            raise ValueError(f"folder={str(folder)!r} is not a folder of .npy files")
        self.files = sorted(p.name for p in self.folder.glob("*.npy"))
        if not self.files:
            raise ValueError(f"folder={str(folder)!r} holds no .npy files; write some first")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> np.ndarray:
        path = self.folder / self.files[index]
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:  # truncated, not .npy, or unreadable
            raise SourceError(f"{path} (sample {index}) cannot be read: {exc}") from exc

    def fetch_batch(self, indices: np.ndarray) -> torch.Tensor:
        """The batch of ``indices`` in one call: ``default_collate`` of the items."""
        return torch.from_numpy(np.stack([self[int(i)] for i in indices]))

    @property
    def fingerprint(self) -> str:
        """Names and sizes of all files plus the bytes of the first and the last one.

        A cheap identity (computed once per loader): a folder with other files, or other
        contents at either end, does not resume this folder's checkpoint.
        """
        digest = hashlib.blake2b(digest_size=8)
        for name in self.files:
            digest.update(f"{name}:{(self.folder / name).stat().st_size};".encode())
        for name in dict.fromkeys((self.files[0], self.files[-1])):  # ordered, no repeat
            digest.update((self.folder / name).read_bytes())
        return f"npy-folder:{len(self.files)}:{digest.hexdigest()}"


def write_npy_folder(folder: str | os.PathLike[str], arrays: list[np.ndarray]) -> NpyFolder:
    """Write one ``.npy`` file per array (names sort in order) and open the folder."""
    path = pathlib.Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    width = len(str(max(len(arrays) - 1, 0)))
    for i, array in enumerate(arrays):
        np.save(path / f"{i:0{width}d}.npy", array, allow_pickle=False)
    return NpyFolder(path)


def main() -> None:
    from meshfeed import DataLoader

    with tempfile.TemporaryDirectory() as tmp:
        write_npy_folder(tmp, [np.full(3, i, dtype=np.int64) for i in range(10)])
        loader = DataLoader(NpyFolder(tmp), batch_size=2, mesh={"dp": 2}, rank=0, seed=1)
        for epoch in loader.epochs(2):
            print(f"epoch {epoch}:", [batch[:, 0].tolist() for batch in loader])


if __name__ == "__main__":
    main()
