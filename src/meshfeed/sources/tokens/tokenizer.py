"""Tokenizers for ``meshfeed convert`` and ``LazyDataset.encode``: a spec becomes text -> token ids.

:func:`load_tokenizer` takes, in this order of checks:

- a :class:`TextTokenizer` (returned as is), a callable ``text -> ids`` or an object with
  ``.encode(text)`` (an HF ``tokenizers.Tokenizer``, a ``transformers`` tokenizer, a tiktoken
  ``Encoding``, ...);
- ``"bytes"``: the UTF-8 bytes, ids 0-255 (tests and demos; no end-of-document token);
- a path to a ``tokenizer.json`` file (HF ``tokenizers.Tokenizer.from_file``);
- a path to a folder saved by ``save_pretrained`` (``transformers.AutoTokenizer`` when installed,
  else the folder's ``tokenizer.json`` through ``tokenizers``);
- ``"module:callable"``, imported with the current folder on ``sys.path``, naming a function
  ``text -> ids`` or a tokenizer object (or a no-argument factory of one);
- a tiktoken encoding name such as ``"cl100k_base"`` (needs ``pip install tiktoken``).

Whatever ``encode`` returns is read by :func:`token_ids`: an object with ``.ids`` (an HF
``Encoding``), a mapping with ``"input_ids"`` (a ``BatchEncoding``), or a sequence of ints.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshfeed.protocols import TextEncoder
from meshfeed.storage.urls import local_only

__all__ = ["TextTokenizer", "load_tokenizer", "token_ids"]

#: End-of-document tokens looked up in a ``tokenizer.json``, most usual first.
EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


def token_ids(encoded: Any) -> np.ndarray:
    """The token ids of what a tokenizer's ``encode`` returned, as a 1-D int64 array."""
    if hasattr(encoded, "ids"):  # tokenizers.Encoding
        encoded = encoded.ids
    elif isinstance(encoded, Mapping) and "input_ids" in encoded:  # transformers BatchEncoding
        encoded = encoded["input_ids"]
    arr = np.asarray(encoded)
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TypeError(
            f"the tokenizer returned {arr.ndim}-D {arr.dtype} values; encode(text) must return "
            "a list of int token ids (or an object with .ids, or a dict with 'input_ids')"
        )
    return arr.astype(np.int64, copy=False)


@dataclass(frozen=True, slots=True)
class TextTokenizer:
    """``text -> int64 token ids`` with a name and, where the tokenizer has one, its eod id."""

    name: str
    encode: Callable[[str], Any]
    eod_id: int | None = None

    def __call__(self, text: str) -> np.ndarray:
        return token_ids(self.encode(text))


def _byte_encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def _special_eod(tok: Any) -> int | None:
    """The end-of-document id of an HF ``tokenizers.Tokenizer`` (``token_to_id``) or a
    ``transformers`` tokenizer (``get_vocab``: one saved without a ``tokenizer_config.json``
    has no ``eos_token_id``), if its vocabulary names one of ``EOD_TOKENS``."""
    if hasattr(tok, "token_to_id"):
        lookup = tok.token_to_id
    elif hasattr(tok, "get_vocab"):
        lookup = tok.get_vocab().get
    else:
        return None
    for name in EOD_TOKENS:
        found = lookup(name)
        if found is not None:
            return int(found)
    return None


def _from_object(obj: Any, name: str) -> TextTokenizer:
    eod = None
    for attr in ("eod_id", "eod", "eos_token_id", "eot_token"):
        value = getattr(obj, attr, None)
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            eod = int(value)
            break
    if eod is None:
        eod = _special_eod(obj)
    if isinstance(obj, TextEncoder):
        encode = obj.encode
        if type(obj).__module__.startswith("transformers"):
            # Megatron's preprocess_data adds no BOS/EOS while tokenizing: nor does meshfeed.
            encode = _NoSpecial(obj)
        return TextTokenizer(name, encode, eod)
    if callable(obj):
        return TextTokenizer(name, obj, eod)
    raise TypeError(
        f"tokenizer {name} is a {type(obj).__name__}: neither callable nor with .encode(text)"
    )


@dataclass(frozen=True, slots=True)
class _NoSpecial:
    tok: Any

    def __call__(self, text: str) -> Any:
        return self.tok.encode(text, add_special_tokens=False)


def _from_path(path: Path, spec: str) -> TextTokenizer:
    if path.is_dir():
        try:
            transformers = importlib.import_module("transformers")
        except ImportError:
            transformers = None
        if transformers is not None:
            return _from_object(transformers.AutoTokenizer.from_pretrained(path), spec)
        path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"tokenizer folder {spec!r} has no tokenizer.json and transformers is not "
                "installed; pip install transformers to load it"
            )
    try:
        tokenizers = importlib.import_module("tokenizers")
    except ImportError as e:
        raise ImportError(f"tokenizer {spec!r} needs tokenizers: pip install tokenizers") from e
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise ValueError(f"{path} is not a tokenizers tokenizer.json ({e})") from e
    return TextTokenizer(spec, tok.encode, _special_eod(tok))


def _from_module(spec: str) -> TextTokenizer:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"tokenizer {spec!r} must look like 'module:callable'")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"cannot import tokenizer module {module_name!r} ({e}); run from the folder that "
            "holds it or add that folder to PYTHONPATH"
        ) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"module {module_name!r} has no attribute {attr!r} (tokenizer {spec!r})"
            )
        obj = getattr(obj, part)
    if isinstance(obj, type):  # a class: a tokenizer made with no arguments
        try:
            obj = obj()
        except Exception as e:  # the class's own error, whatever its type: give it context
            raise ValueError(
                f"tokenizer {spec!r} names a class that cannot be made with no arguments ({e}); "
                "name a function text -> ids or a ready tokenizer object, or pass the path of "
                "a tokenizer.json"
            ) from e
    if not callable(obj) and not isinstance(obj, TextEncoder):
        raise ValueError(
            f"tokenizer {spec!r} is not callable; name a function text -> list[int] or an "
            "object with .encode(text)"
        )
    return _from_object(obj, spec)


def load_tokenizer(spec: Any) -> TextTokenizer:
    """Resolve ``spec`` (see the module doc) into a :class:`TextTokenizer`."""
    if isinstance(spec, TextTokenizer):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        return _from_object(spec, type(spec).__name__)
    text = os.fspath(spec)
    if text == "bytes":
        return TextTokenizer("bytes", _byte_encode, None)
    path = local_only(text, what="a tokenizer", fix="download its tokenizer.json (or folder) first")
    if path.exists():
        return _from_path(path, text)
    if ":" in text:
        return _from_module(text)
    if text.endswith(".json") or os.sep in text:
        raise FileNotFoundError(f"tokenizer file {text} does not exist")
    try:
        tiktoken = importlib.import_module("tiktoken")
    except ImportError:
        raise ValueError(
            f"tokenizer {text!r} is not 'bytes', a tokenizer.json, a tokenizer folder or "
            "'module:callable'; if it is a tiktoken encoding name, pip install tiktoken"
        ) from None
    try:
        enc = tiktoken.get_encoding(text)
    except ValueError as e:
        raise ValueError(
            f"tokenizer {text!r} is not 'bytes', a file or folder, 'module:callable' or a "
            f"tiktoken encoding ({e})"
        ) from e
    return TextTokenizer(text, enc.encode_ordinary, int(enc.eot_token))
