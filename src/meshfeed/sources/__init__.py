"""Where samples come from: token corpora, Parquet / Arrow, HF datasets, streams, mixtures."""

from meshfeed.sources.convert import convert
from meshfeed.sources.hf import HFSource
from meshfeed.sources.indexed import IndexedFormatError, IndexedWriter, TokenCorpus, write_indexed
from meshfeed.sources.parquet import ArrowSource, ParquetSource
from meshfeed.sources.windows import TokenDocuments, TokenWindows

__all__ = [
    "ArrowSource",
    "HFSource",
    "IndexedFormatError",
    "IndexedWriter",
    "ParquetSource",
    "TokenCorpus",
    "TokenDocuments",
    "TokenWindows",
    "convert",
    "write_indexed",
]
