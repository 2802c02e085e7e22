"""Data the library reads: shard folders bigger than memory (:mod:`reprotrain.data.shards`;
written by :mod:`reprotrain.data.shard_writer`)."""
