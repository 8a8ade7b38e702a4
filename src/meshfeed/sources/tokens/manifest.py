"""A corpora manifest: ``corpora.json`` names every Megatron corpus under a folder with its
fingerprint, so a mixture of 10,000 corpora starts by reading one file (#32).

``meshfeed corpora FOLDER`` (or :func:`write_corpora_manifest`) opens every ``PREFIX.idx``
under ``FOLDER`` with all the checks of :class:`~meshfeed.sources.tokens.indexed.TokenCorpus`
and writes each prefix (relative to the folder) and fingerprint. :func:`open_corpora` reads it
back as corpora opened on first use (``TokenCorpus(prefix, fingerprint=...)``): their document
counts, dtypes and fingerprints come from the manifest, so a :class:`~meshfeed.Mixture` of
them is built without touching a corpus file, and a first batch opens only the corpora it
reads. Each is checked when opened exactly as an eagerly opened corpus is, then against its
recorded fingerprint: a corpus rewritten after the manifest is refused by name.

>>> corpora = open_corpora("data/corpora")  # doctest: +SKIP
>>> mix = Mixture({n: TokenDocuments(c) for n, c in corpora.items()}, weights)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from meshfeed.sources.tokens.indexed import TokenCorpus
from meshfeed.storage import Ranged, ShardCache, StorageOptions, is_url

__all__ = ["MANIFEST_NAME", "add_subcommand", "open_corpora", "write_corpora_manifest"]

MANIFEST_NAME = "corpora.json"
_KIND = "meshfeed_corpora"
_VERSION = 1


def write_corpora_manifest(folder: str | os.PathLike[str]) -> Path:
    """Check every corpus under ``folder`` and write ``folder/corpora.json``; its path.

    Cost: every corpus opened and checked once (its ``.idx`` read, 4 KB at each end of each
    file hashed). The manifest replaces any old one in one step (a rename); a corpus that fails
    its checks is refused by name and nothing is written.
    """
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(
            f"{root} is not a folder; pass the folder that holds the PREFIX.idx/PREFIX.bin "
            f"corpora (got {folder!r})"
        )
    names = sorted(p.relative_to(root).as_posix()[: -len(".idx")] for p in root.rglob("*.idx"))
    if not names:
        raise FileNotFoundError(f"no PREFIX.idx under {root}; write corpora there first")
    # A prefix named like a file ("x.bin") opens as the corpus "x" (a path may name the .bin),
    # so the manifest would give it another corpus's data
    misread = [n for n in names if n.endswith((".bin", ".idx"))]
    if misread:
        raise ValueError(
            f"corpora {misread} under {root} have prefixes ending in .bin or .idx, which open "
            f"as the corpus without that suffix ({misread[0][:-4]!r}); rename them (e.g. "
            f"{misread[0][:-4] + '_' + misread[0][-3:]!r})"
        )
    fingerprints = [TokenCorpus.open(root / name).fingerprint for name in names]
    text = json.dumps(
        {"kind": _KIND, "version": _VERSION, "names": names, "fingerprints": fingerprints},
        separators=(",", ":"),
    )
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{MANIFEST_NAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / MANIFEST_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return root / MANIFEST_NAME


def open_corpora(
    path: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | None = None,
    storage_options: StorageOptions | None = None,
    ranged: Ranged = None,
) -> dict[str, TokenCorpus]:
    """The corpora a manifest names (``path``: its folder or the ``corpora.json``), by name,
    each opened on first use and checked then against its recorded fingerprint.

    Reads the manifest alone: O(corpora) in Python objects, no file of any corpus. A URL
    folder (``s3://bucket/corpora``, a manifest written locally and uploaded with its
    corpora) is read through the node's shard cache; ``cache_dir``, ``cache_limit``,
    ``storage_options`` and ``ranged`` go to each corpus (see :class:`TokenCorpus`), which
    fetches its files when first read.
    """
    where = os.fspath(path)
    remote: dict[str, Any] = {}
    if is_url(where):
        root = where.removesuffix(MANIFEST_NAME).rstrip("/")
        remote = dict(
            cache_dir=cache_dir,
            cache_limit=cache_limit,
            storage_options=storage_options,
            ranged=ranged,
        )
        cache = ShardCache(cache_dir, cache_limit=cache_limit, storage_options=storage_options)
        manifest = Path(cache.local_path(f"{root}/{MANIFEST_NAME}"))
        named = f"{root}/{MANIFEST_NAME}"
    else:
        manifest = Path(where)
        if manifest.is_dir():
            manifest = manifest / MANIFEST_NAME
        root, named = os.fspath(manifest.parent), os.fspath(manifest)
    try:
        raw = json.loads(manifest.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{named} does not exist; write it with `meshfeed corpora {manifest.parent}`"
        ) from None
    names, fingerprints = _parse(raw, named)
    corpora = {}
    for name, fingerprint in zip(names, fingerprints, strict=True):
        try:
            corpora[name] = TokenCorpus(f"{root}/{name}", fingerprint=fingerprint, **remote)
        except ValueError as e:
            raise ValueError(f"{named}: corpus {name!r}: {e}") from None
    return corpora


def _parse(raw: Any, manifest: str) -> tuple[list[str], list[str]]:
    """The names and fingerprints of a manifest, refused by name unless well formed."""
    fix = f"write it again with `meshfeed corpora {manifest.rsplit('/', 1)[0]}`"
    if not isinstance(raw, dict) or raw.get("kind") != _KIND:
        raise ValueError(f"{manifest} is not a meshfeed corpora manifest; {fix}")
    if raw.get("version") != _VERSION:
        raise ValueError(
            f"{manifest} has manifest version {raw.get('version')!r}, this meshfeed reads "
            f"{_VERSION}; {fix}"
        )
    names, fingerprints = raw.get("names"), raw.get("fingerprints")
    if not isinstance(names, list) or not isinstance(fingerprints, list) or not names:
        raise ValueError(f"{manifest} has no lists 'names' and 'fingerprints'; {fix}")
    if len(names) != len(fingerprints) or len(set(names)) != len(names):
        raise ValueError(
            f"{manifest} has {len(names)} names (some repeated?) for {len(fingerprints)} "
            f"fingerprints; {fix}"
        )
    for name in names:
        if not isinstance(name, str) or not name or name.startswith("/") or ".." in name:
            raise ValueError(
                f"{manifest} names a corpus outside its folder (got {name!r}); corpora must "
                f"lie under the manifest's folder; {fix}"
            )
    return names, fingerprints


def add_subcommand(subparsers: Any) -> None:
    """Register ``meshfeed corpora``."""
    p = subparsers.add_parser(
        "corpora",
        help="check every Megatron corpus under a folder and write its corpora.json manifest",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("folder", help="the folder that holds PREFIX.idx / PREFIX.bin corpora")
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress (corpora shows none; as every command)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    out = write_corpora_manifest(args.folder)
    n = len(json.loads(out.read_text(encoding="utf-8"))["names"])
    print(f"wrote {out}: {n} corpora checked")
    return 0
