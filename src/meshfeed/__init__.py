"""meshfeed: the data layer for large-model training."""

from meshfeed.collate import default_collate
from meshfeed.fetch import SampleError
from meshfeed.loader import DataLoader
from meshfeed.mesh import DataMesh
from meshfeed.rng import FetchInfo, fetch_info, sample_generator, sample_rng

__all__ = [
    "DataLoader",
    "DataMesh",
    "FetchInfo",
    "SampleError",
    "default_collate",
    "fetch_info",
    "sample_generator",
    "sample_rng",
]
