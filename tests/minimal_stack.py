"""Run pytest as on a minimal stack: every optional extra hidden from the import system (#27).

``python -m tests.minimal_stack [pytest arguments]`` runs the tests with torch, numpy, tqdm,
pytest and psutil only, as far as imports can tell: a test that needs an extra must skip, naming
it, never fail or break collection. Development and CI machines have every extra installed, so
this is where such a mistake shows. Only this process hides them: worker processes a test
starts see what is installed (a test that skipped never starts them). Plugins are not loaded
from entry points, as on a stack where none is installed.
"""

import os
import sys
from collections.abc import Sequence

__all__ = ["EXTRAS", "main"]

#: Top-level modules of the optional extras (``pyproject.toml``), their services and the peers
#: the tests compare with. ``fsspec``, ``jinja2`` and ``sympy`` stay: torch itself needs them.
EXTRAS = frozenset(
    {
        "aiohttp",
        "boto3",
        "botocore",
        "datasets",
        "deepspeed",
        "grain",
        "hypothesis",
        "litdata",
        "matplotlib",
        "megatron",
        "moto",
        "pyarrow",
        "ray",
        "s3fs",
        "streaming",
        "tiktoken",
        "tokenizers",
        "torchdata",
        "transfer_queue",
        "transformers",
        "webdataset",
        "zstandard",
    }
)


def main(argv: Sequence[str]) -> int:
    """Run pytest on ``argv`` with the extras hidden; returns its exit code."""
    loaded = sorted(name for name in sys.modules if name.partition(".")[0] in EXTRAS)
    if loaded:
        raise RuntimeError(f"extras were imported before they could be hidden (got {loaded=})")
    # None in sys.modules: `import x` raises ModuleNotFoundError, importlib.util.find_spec(x)
    # answers None, as for a module that is not installed.
    sys.modules.update(dict.fromkeys(EXTRAS))
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    import pytest

    return int(pytest.main(list(argv)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
