"""The comm layer: the collectives a strategy calls (`all_reduce(t)`, `broadcast(t, src)`, ... as in
torch.distributed), groups, reduce ops, byte accounting, the counted mean over nodes, compression and flat buckets.

A strategy talks to other nodes only through these functions; each call goes to the calling node's backend (the
in-process sim, or torch.distributed) and adds the bytes that node sends to its count.
"""

from exogym.comm.collectives import (all_gather, all_reduce, alive_ranks, barrier, broadcast, get_rank,
                                     get_world_size, in_running_node, new_group, reduce_scatter)
from exogym.comm.messages import (SERVER, Message, Server, irecv, isend, now, read_server, recv, send, serve, poll)
from exogym.comm.transport import CollectiveError, Group, MessageError, ReduceOp, Work

__all__ = ["ReduceOp", "Group", "Work", "CollectiveError", "all_reduce", "broadcast", "all_gather", "reduce_scatter",
           "barrier", "new_group", "get_rank", "get_world_size", "alive_ranks", "in_running_node",
           "SERVER", "Message", "MessageError", "Server", "send", "isend", "recv", "irecv", "poll", "serve", "read_server",
           "now"]
