"""`meshfeed convert`: text, JSONL and Parquet inputs to a token corpus or shards, and the
staging of every writer's output to a URL."""
