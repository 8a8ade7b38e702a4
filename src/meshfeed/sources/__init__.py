"""Where samples come from: token corpora, Parquet / Arrow, HF datasets, streams (MDS and
WebDataset shards among them), mixtures, and SFT samples from chat data."""

from meshfeed.sources.chat import ChatSamples, ChatTemplate, JinjaChatTemplate, chat_sample
from meshfeed.sources.convert import convert
from meshfeed.sources.hf import HFSource
from meshfeed.sources.indexed import IndexedFormatError, TokenCorpus
from meshfeed.sources.indexed_write import IndexedWriter, write_indexed
from meshfeed.sources.lazy import LazyDataset
from meshfeed.sources.mds import MDSReader, mds_stream
from meshfeed.sources.mixture import Mixture
from meshfeed.sources.mixture_order import MixtureOrder
from meshfeed.sources.parquet import ArrowSource, ParquetSource
from meshfeed.sources.shards_format import ShardIndex, read_index
from meshfeed.sources.shards_read import ShardFormatReader
from meshfeed.sources.shards_write import write_shards
from meshfeed.sources.stream import ShardedStream
from meshfeed.sources.stream_readers import DefaultReader, default_reader
from meshfeed.sources.webdataset import TarReader, wds_stream
from meshfeed.sources.windows import TokenDocuments, TokenWindows

__all__ = [
    "ArrowSource",
    "ChatSamples",
    "ChatTemplate",
    "DefaultReader",
    "HFSource",
    "IndexedFormatError",
    "IndexedWriter",
    "JinjaChatTemplate",
    "LazyDataset",
    "MDSReader",
    "Mixture",
    "MixtureOrder",
    "ParquetSource",
    "ShardFormatReader",
    "ShardIndex",
    "ShardedStream",
    "TarReader",
    "TokenCorpus",
    "TokenDocuments",
    "TokenWindows",
    "chat_sample",
    "convert",
    "default_reader",
    "mds_stream",
    "wds_stream",
    "read_index",
    "write_indexed",
    "write_shards",
]
