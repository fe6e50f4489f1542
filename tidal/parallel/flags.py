"""The parallel flags in SGLang's vocabulary (--tp-size, --ep-size, --dcp-size, --nnodes, --node-rank,
--dist-init-addr), checked together before anything starts: a bad combination is one clear error at
the command line, not a failure in a rank process minutes into loading."""

from __future__ import annotations

from tidal.parallel.groups import RankPlace


def node_ranks(tp_size: int, nnodes: int, node_rank: int) -> range:
    """The worker ranks node ``node_rank`` hosts (consecutive: node k the k-th tp/nnodes of them)."""
    if nnodes < 1 or tp_size % nnodes:
        raise ValueError(f"--nnodes {nnodes} must divide --tp-size {tp_size}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} is not in 0..{nnodes - 1}")
    per = tp_size // nnodes
    return range(node_rank * per, (node_rank + 1) * per)


def split_addr(addr: str) -> tuple[str, int]:
    """"host:port" (SGLang's --dist-init-addr; also "tcp://host:port") as (host, port)."""
    host, sep, port = addr.removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--dist-init-addr {addr!r}: expected host:port with a port in 0..65535")
    return host, int(port)


def check_flags(tp_size: int, ep_size: int = 1, dcp_size: int = 1, nnodes: int = 1, node_rank: int = 0,
                dist_init_addr: str | None = None) -> None:
    """Raise ValueError naming the flag when these do not describe one launch of the ranks."""
    RankPlace(0, tp_size, ep_size, dcp_size)  # sizes >= 1, tp % ep == 0, tp % dcp == 0
    node_ranks(tp_size, nnodes, node_rank)
    if nnodes > 1 and not dist_init_addr:
        raise ValueError(f"--nnodes {nnodes} needs --dist-init-addr host:port (the address every node joins)")
    if dist_init_addr is not None:
        _, port = split_addr(dist_init_addr)
        if nnodes > 1 and port == 0:
            raise ValueError(f"--dist-init-addr {dist_init_addr!r}: the other nodes need a fixed port, not 0")
