"""Writes MDS datasets with MosaicML Streaming's own MDSWriter and reads them back with its own
reader (run by tests/sources/test_sources_mds.py under a Python that has ``streaming``).

usage: python mds_peer.py OUT write        -> OUT/{plain,zstd,gz,images}/ and OUT/expected.pkl
       python mds_peer.py OUT dataset NAME... -> OUT/dataset-NAME.pkl (StreamingDataset's samples)
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import sys
import tempfile
import types

import numpy as np


def _import_streaming(base_too: bool) -> None:
    """Import streaming's submodules without its package __init__ (which pulls in torchvision
    and transformers, absent here)."""
    spec = importlib.util.find_spec("streaming")
    assert spec is not None and spec.submodule_search_locations is not None
    root = list(spec.submodule_search_locations)
    names = [("streaming", root)]
    if base_too:
        names.append(("streaming.base", [os.path.join(root[0], "base")]))
    for name, path in names:
        pkg = types.ModuleType(name)
        pkg.__path__ = path
        sys.modules[name] = pkg


COLUMNS = {
    "id": "int",
    "text": "str",
    "blob": "bytes",
    "tokens": "ndarray:int32",
    "score": "float64",
    "meta": "json",
    "small": "int8",
    "count": "uint16",
    "half": "float16",
    "grid": "ndarray:float32:2,3",
    "any": "ndarray",
    "big": "str_int",
}


def sample(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "id": i * 7 - 100,
        "text": f"sample {i} " + "é" * (i % 5),
        "blob": bytes(rng.integers(0, 256, i % 13, dtype=np.uint8)),
        "tokens": rng.integers(-(2**31), 2**31 - 1, 1 + i % 17, dtype=np.int32),
        "score": float(rng.normal()),
        "meta": {"i": i, "tags": ["a"] * (i % 3), "nested": {"x": i / 3}},
        "small": np.int8(i % 100 - 50),
        "count": np.uint16(i * 31 % 65536),
        "half": np.float16(i / 8),
        "grid": rng.normal(size=(2, 3)).astype(np.float32),
        "any": rng.integers(0, 300, size=(1 + i % 3, 2), dtype=np.uint64 if i % 2 else np.int16),
        "big": 10**30 + i,
    }


def write(out: str) -> None:
    _import_streaming(base_too=True)
    from streaming.base.compression import decompress
    from streaming.base.format.mds.reader import MDSReader
    from streaming.base.format.mds.writer import MDSWriter

    expected = {}
    for name, compression, hashes in (
        ("plain", None, ["sha1"]),
        ("zstd", "zstd", []),
        ("gz", "gz", ["xxh64"]),
    ):
        local = os.path.join(out, name)
        with MDSWriter(
            columns=COLUMNS, out=local, compression=compression, hashes=hashes, size_limit=2048
        ) as w:
            for i in range(90):
                w.write(sample(i))
        with open(os.path.join(local, "index.json")) as f:
            index = json.load(f)
        rows = []
        with tempfile.TemporaryDirectory() as raw:
            for obj in index["shards"]:
                if obj["zip_data"]:  # what StreamingDataset does before reading a shard
                    with open(os.path.join(local, obj["zip_data"]["basename"]), "rb") as f:
                        data = decompress(obj["compression"], f.read())
                    with open(os.path.join(raw, obj["raw_data"]["basename"]), "wb") as f:
                        f.write(data)
                reader = MDSReader.from_json(raw if obj["zip_data"] else local, None, obj)
                rows.extend(
                    reader.decode_sample(reader.get_sample_data(j)) for j in range(obj["samples"])
                )
        expected[name] = rows
    expected["images"] = images(os.path.join(out, "images"))
    with open(os.path.join(out, "expected.pkl"), "wb") as f:
        pickle.dump(expected, f)


def images(local: str) -> list[dict]:
    """A dataset of image columns; returns the bytes MDS stored for each (what meshfeed
    hands back for image encodings)."""
    from PIL import Image
    from streaming.base.format.mds.encodings import mds_encode
    from streaming.base.format.mds.writer import MDSWriter

    columns = {"png": "png", "pil": "pil", "label": "int"}
    rows = []
    with MDSWriter(columns=columns, out=local, size_limit=4096) as w:
        for i in range(6):
            img = Image.fromarray(np.full((4 + i, 5, 3), i * 40, dtype=np.uint8))
            w.write({"png": img, "pil": img, "label": i})
            rows.append({"png": mds_encode("png", img), "pil": mds_encode("pil", img), "label": i})
    return rows


def dataset(out: str, names: list[str]) -> None:
    _import_streaming(base_too=False)
    from streaming.base import StreamingDataset

    for name in names:
        ds = StreamingDataset(local=os.path.join(out, name), shuffle=False, batch_size=1)
        with open(os.path.join(out, f"dataset-{name}.pkl"), "wb") as f:
            pickle.dump([ds.get_item(i) for i in range(len(ds))], f)


if __name__ == "__main__":
    if sys.argv[2] == "write":
        write(sys.argv[1])
    else:
        dataset(sys.argv[1], sys.argv[3:])
