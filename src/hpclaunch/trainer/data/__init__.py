"""What the trainer reads: the shards and the sample order, the loader, each rank's share of a step."""
