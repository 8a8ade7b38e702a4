"""Where samples come from: token corpora, Parquet / Arrow, HF datasets, streams (MDS and
WebDataset shards among them), mixtures, and SFT samples from chat data."""

from meshfeed.sources.converters.convert import convert
from meshfeed.sources.hf import HFSource
from meshfeed.sources.lazy import LazyDataset
from meshfeed.sources.mixture import Mixture
from meshfeed.sources.mixture_order import MixtureOrder
from meshfeed.sources.parquet import ArrowSource, ParquetSource
from meshfeed.sources.shards.format import ShardIndex, read_index
from meshfeed.sources.shards.read import ShardFormatReader
from meshfeed.sources.shards.write import write_shards
from meshfeed.sources.streams.mds import MDSReader, mds_stream
from meshfeed.sources.streams.readers import DefaultReader, default_reader
from meshfeed.sources.streams.stream import ShardedStream
from meshfeed.sources.streams.webdataset import TarReader, wds_stream
from meshfeed.sources.tokens.chat import ChatSamples, ChatTemplate, JinjaChatTemplate, chat_sample
from meshfeed.sources.tokens.indexed import IndexedFormatError, TokenCorpus
from meshfeed.sources.tokens.indexed_write import IndexedWriter, write_indexed
from meshfeed.sources.tokens.manifest import open_corpora, write_corpora_manifest
from meshfeed.sources.tokens.windows import TokenDocuments, TokenWindows

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
    "open_corpora",
    "read_index",
    "wds_stream",
    "write_corpora_manifest",
    "write_indexed",
    "write_shards",
]
