"""The memory tier's snapshots: each rank's state in its node's shared memory, a copy on a peer node.

A snapshot is rank-local: rank ``r``'s staged buffer (its shards of the model, optimizer and EMA, as
the staging copy lays them out) and a JSON description beside it (slots, the serialized plain values,
the step, the world size). No DCP plan, no metadata shared between ranks: each rank writes and reads
its own shard alone, so a snapshot costs no collective, and it restores only at the world size and
sharding that wrote it (any other change goes to the disk tier, which reshards).

* ``buddies``: who is whose buddy (the same local rank on the next node), and, at a restore, the newest
  snapshot every rank's shard of which is still somewhere in the allocation, and who sends what.
* ``store``: the files of one node (``<root>/<node>/step-<step>-w<world>/rank-<r>.bin|.json``),
  published by rename with the description last, so a half-written shard is never read.
* ``shard``: what goes into a shard's description, and filling the live state back from one.
* ``transfer``: the thread that writes a rank's shard, sends it to the buddy and receives the one it
  keeps for its ward, over a gloo group of its own; and the pulls of a restore.
"""
