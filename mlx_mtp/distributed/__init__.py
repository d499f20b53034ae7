"""Pipeline parallelism over `mx.distributed`: the group's control plane (group.py) and
the pipeline of ranks with MTP speculative decoding across them (pipeline.py)."""
