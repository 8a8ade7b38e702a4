"""meshfeed's shard format: the index (by column), encoding, writing locally or to a bucket,
and reading (open shards, decoded blocks, samples)."""
