"""Data the library reads: shard folders bigger than memory (:mod:`reprotrain.data.shards`)."""
