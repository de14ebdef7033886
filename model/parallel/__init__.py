"""Model parallelism applied outside the model definitions: tensor-parallel shards, expert sharding."""
