"""meshfeed: the data layer for large-model training."""

from meshfeed.mesh import DataMesh

__all__ = ["DataMesh"]
