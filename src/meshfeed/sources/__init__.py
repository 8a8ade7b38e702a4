"""Where samples come from: token corpora, Parquet / Arrow, HF datasets, streams, mixtures."""

from meshfeed.sources.convert import convert
from meshfeed.sources.hf import HFSource
from meshfeed.sources.indexed import IndexedFormatError, IndexedWriter, TokenCorpus, write_indexed
from meshfeed.sources.lazy import LazyDataset
from meshfeed.sources.mixture import Mixture, MixtureOrder
from meshfeed.sources.parquet import ArrowSource, ParquetSource
from meshfeed.sources.shards_format import ShardIndex, read_index
from meshfeed.sources.shards_read import ShardFormatReader
from meshfeed.sources.shards_write import write_shards
from meshfeed.sources.stream import ShardedStream, default_reader
from meshfeed.sources.stream_loader import StreamLoader, StreamRankError
from meshfeed.sources.windows import TokenDocuments, TokenWindows

__all__ = [
    "ArrowSource",
    "HFSource",
    "IndexedFormatError",
    "IndexedWriter",
    "LazyDataset",
    "Mixture",
    "MixtureOrder",
    "ParquetSource",
    "ShardFormatReader",
    "ShardIndex",
    "ShardedStream",
    "StreamLoader",
    "StreamRankError",
    "TokenCorpus",
    "TokenDocuments",
    "TokenWindows",
    "convert",
    "default_reader",
    "read_index",
    "write_indexed",
    "write_shards",
]
