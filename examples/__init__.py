"""Runnable examples of meshfeed (importable so that tests and worker processes can use them)."""
