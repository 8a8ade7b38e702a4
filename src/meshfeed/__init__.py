"""meshfeed: the data layer for large-model training."""

from meshfeed.collate import default_collate, pad_collate
from meshfeed.fetch import Failed, SampleError
from meshfeed.loader import DataLoader
from meshfeed.mesh import DataMesh
from meshfeed.rng import FetchInfo, fetch_info, sample_generator, sample_rng
from meshfeed.sources.lazy import LazyDataset
from meshfeed.sources.mixture import Mixture
from meshfeed.stream_loader import StreamLoader

__all__ = [
    "DataLoader",
    "DataMesh",
    "Failed",
    "FetchInfo",
    "LazyDataset",
    "Mixture",
    "SampleError",
    "StreamLoader",
    "default_collate",
    "fetch_info",
    "pad_collate",
    "sample_generator",
    "sample_rng",
]
