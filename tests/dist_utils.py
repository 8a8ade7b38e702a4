"""Multi-process test support: real gloo ranks via meshfeed.launch."""

from meshfeed.launch import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
