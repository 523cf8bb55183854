"""One model over N tensor-parallel ranks, each a process holding its share of every layer's
heads (and its pool shard): `split` (which heads and MLP columns a rank owns, the one place that
rule is written; it needs no process group), `sharding` (a loaded transformers model turned into
one rank's shard, Megatron style, its row-split layers summed over the process group) and
`local_ranks` (N local processes of one function in one process group: the tests' and a
tensor-parallel worker's way to start its ranks).

May import `worker.model` (the families) and `worker.errors`; nothing else of the worker (the
loop, `worker.step`, the attention): a model is sharded and its ranks started without them.
"""
