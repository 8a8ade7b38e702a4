"""Streams: ShardedStream over any shards and its readers (default, cached URLs, WebDataset
tars, MosaicML MDS), with the row counts taken at start."""
