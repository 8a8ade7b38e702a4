"""`meshfeed convert`: text, JSONL and Parquet inputs to a token corpus or shards (the staging
of writer output to a URL is :mod:`meshfeed.storage.output`)."""
