"""The network model: how long a collective takes on a given cluster.

Notation: N bytes of payload (the full tensor; for all-gather the gathered output), R members
in the group, W the group's bandwidth in bytes/s (its slowest link), a the latency in seconds.

    all-reduce      ring: 2 N (R-1)/R / W + a      (DiLoCo scaling laws, arXiv 2503.09799, app. A)
                    tree: 2 log2(R) (N/W + a)       (reduce up a binary tree, broadcast down)
                    ps:   2 (R-1) N / W + 2 a      (every member's N through the server's link, twice)
    reduce-scatter  ring: (R-1)/R N / W + a         tree: log2(R) (N/W + a)    ps: (R-1) N / W + a
    all-gather      ring: (R-1)/R N / W + a         tree: log2(R) (N/W + a)    ps: (R-1) N / W + a
    broadcast       ring: N / W + a  (pipelined)    tree: log2(R) (N/W + a)    ps: (R-1) N / W + a
    barrier         a (ring, ps), log2(R) a (tree)
    any op with R = 1 takes 0 s.

The group's W and a: nodes can sit in datacenters (fast links inside, slow between); a group
spanning more than one datacenter runs at the inter-datacenter bandwidth and latency. Per-node
bandwidth caps (a node on a slow uplink) lower W further: the slowest member sets the pace.

Point-to-point messages (exogym.comm.messages) take a + N / W on the link between sender and receiver, where W
is the smallest of the link's bandwidth, the sender's upload cap (node_upload, server_upload) and the receiver's
download cap (node_download, server_download); per-node node_bandwidth caps both directions. The server (a
strategy's, see exogym.comm.messages.Server) has its own link: server_bandwidth and server_latency (default: the
cluster's bandwidth and latency). Links are not shared: two messages on one link at once each get W (no
congestion is modelled).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Network", "parse_bandwidth", "parse_seconds", "PRESETS", "TOPOLOGIES", "SERVER"]

SERVER = -1  # the rank of a strategy's server in the network model and in messages (it sorts before every node)

TOPOLOGIES = ("ring", "tree", "ps")

_BW_UNITS = {"bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
             "b/s": 8, "kb/s": 8e3, "mb/s": 8e6, "gb/s": 8e9, "tb/s": 8e12}  # bits/s (bytes/s for B/s)
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"


def parse_bandwidth(value: float | str, name: str = "bandwidth") -> float:
    """Bytes per second from a number of bits/s (1e9) or a string: "1Gbps", "400 Gbit/s", "100MB/s", "inf"."""
    if isinstance(value, str):
        text = value.strip().replace("bit/s", "bps").replace("bits/s", "bps")
        if text.lower() in ("inf", "infinite"):
            return math.inf
        m = re.fullmatch(_NUMBER + r"([kmgtKMGT]?)(bps|B/s)", text)
        if not m:
            raise ValueError(f"{name}={value!r} is not a bandwidth; write e.g. '1Gbps', '400 Gbit/s', '100MB/s' "
                             "or a number of bits per second")
        number, prefix, unit = m.groups()
        bits = float(number) * _BW_UNITS[prefix.lower() + ("bps" if unit == "bps" else "b/s")]
        return _positive(bits / 8, name, value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of bits/s or a string like '1Gbps', got {value!r}")
    return _positive(value / 8, name, value)


def parse_seconds(value: float | str, name: str = "latency") -> float:
    """Seconds from a number (0.02) or a string: "20ms", "100us", "0.1 s"."""
    if isinstance(value, str):
        m = re.fullmatch(_NUMBER + r"(s|ms|us|µs|ns)", value.strip())
        if not m:
            raise ValueError(f"{name}={value!r} is not a duration; write e.g. '20ms', '100us', '0.5s' or seconds")
        seconds = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be seconds or a string like '20ms', got {value!r}")
    else:
        seconds = float(value)
    if not seconds >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return seconds


def _positive(bytes_per_s: float, name: str, given: object) -> float:
    if not bytes_per_s > 0:
        raise ValueError(f"{name} must be > 0, got {given!r}")
    return bytes_per_s


@dataclass(frozen=True)
class Network:
    """A cluster's links. Bandwidths take bits/s numbers or strings ("1Gbps"); latencies seconds or "20ms".

    datacenters: lists of ranks that share fast links (bandwidth/latency); between datacenters
        the links run at inter_bandwidth/inter_latency. Default: one datacenter.
    node_bandwidth: optional per-rank caps (a node on a slow uplink slows every group it is in).
    node_upload / node_download: optional per-rank caps on what a node sends / receives in point-to-point
        messages (a home connection: node_upload=["10Mbps"] * K, node_download=["100Mbps"] * K).
    server_bandwidth / server_latency: the server's link (default: bandwidth / latency); server_upload /
        server_download cap what it sends / receives.
    """

    bandwidth: float | str = "100Gbps"
    latency: float | str = "1ms"
    topology: str = "ring"
    datacenters: Sequence[Sequence[int]] | None = None
    inter_bandwidth: float | str | None = None
    inter_latency: float | str | None = None
    node_bandwidth: Sequence[float | str] | None = None
    node_upload: Sequence[float | str] | None = None
    node_download: Sequence[float | str] | None = None
    server_bandwidth: float | str | None = None
    server_latency: float | str | None = None
    server_upload: float | str | None = None
    server_download: float | str | None = None

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {list(TOPOLOGIES)}, got {self.topology!r}")
        set_ = object.__setattr__  # frozen: normalise units once, here
        set_(self, "_w", parse_bandwidth(self.bandwidth))
        set_(self, "_a", parse_seconds(self.latency))
        if self.datacenters is not None:
            if self.inter_bandwidth is None or self.inter_latency is None:
                raise ValueError("datacenters=... needs inter_bandwidth and inter_latency for the links between them")
            ranks = [r for dc in self.datacenters for r in dc]
            if len(ranks) != len(set(ranks)) or sorted(ranks) != list(range(len(ranks))):
                raise ValueError(f"datacenters must partition the ranks 0..K-1 once each, got {self.datacenters}")
            set_(self, "_dc", {r: i for i, dc in enumerate(self.datacenters) for r in dc})
            set_(self, "_inter_w", parse_bandwidth(self.inter_bandwidth, "inter_bandwidth"))
            set_(self, "_inter_a", parse_seconds(self.inter_latency, "inter_latency"))
        elif self.inter_bandwidth is not None or self.inter_latency is not None:
            raise ValueError("inter_bandwidth/inter_latency only mean something with datacenters=[[...], [...]]")
        caps = None
        if self.node_bandwidth is not None:
            caps = [parse_bandwidth(b, f"node_bandwidth[{i}]") for i, b in enumerate(self.node_bandwidth)]
        set_(self, "_caps", caps)
        for name in ("node_upload", "node_download"):
            given = getattr(self, name)
            set_(self, f"_{name}", None if given is None else
                 [parse_bandwidth(b, f"{name}[{i}]") for i, b in enumerate(given)])
        set_(self, "_server_w", self._w if self.server_bandwidth is None
             else parse_bandwidth(self.server_bandwidth, "server_bandwidth"))
        set_(self, "_server_a", self._a if self.server_latency is None
             else parse_seconds(self.server_latency, "server_latency"))
        for name in ("server_upload", "server_download"):
            given = getattr(self, name)
            set_(self, f"_{name}", math.inf if given is None else parse_bandwidth(given, name))

    @classmethod
    def preset(cls, name: str, **overrides) -> "Network":
        try:
            return cls(**{**PRESETS[name], **overrides})
        except KeyError:
            raise ValueError(f"unknown network preset {name!r}; choose one of {sorted(PRESETS)}") from None

    def check_nodes(self, num_nodes: int) -> None:
        """Raise if the description does not fit a run of num_nodes nodes."""
        if self.datacenters is not None and len(self._dc) != num_nodes:
            raise ValueError(f"datacenters cover {len(self._dc)} ranks but the run has num_nodes={num_nodes}")
        if self._caps is not None and len(self._caps) != num_nodes:
            raise ValueError(f"node_bandwidth has {len(self._caps)} entries but the run has num_nodes={num_nodes}")
        for name in ("node_upload", "node_download"):
            caps = getattr(self, f"_{name}")
            if caps is not None and len(caps) != num_nodes:
                raise ValueError(f"{name} has {len(caps)} entries but the run has num_nodes={num_nodes}")

    def link(self, ranks: Sequence[int]) -> tuple[float, float]:
        """(bytes/s, latency s) of the slowest link a group of these ranks uses."""
        w, a = self._w, self._a
        if self.datacenters is not None and len({self._dc[r] for r in ranks}) > 1:
            w, a = min(w, self._inter_w), max(a, self._inter_a)
        if self._caps is not None:
            w = min([w] + [self._caps[r] for r in ranks])
        return w, a

    def message_seconds(self, nbytes: int, src: int, dst: int) -> float:
        """Seconds a point-to-point message of `nbytes` takes from `src` to `dst` (node ranks, or SERVER):
        latency + nbytes / W, W the smallest of the link's bandwidth, src's upload cap and dst's download cap."""
        if src == dst:
            return 0.0
        if SERVER in (src, dst):
            w, a = self._server_w, self._server_a
            node = dst if src == SERVER else src
            if self._caps is not None:
                w = min(w, self._caps[node])
        else:
            w, a = self.link((src, dst))
        up = self._server_upload if src == SERVER else (self._node_upload[src] if self._node_upload else math.inf)
        down = (self._server_download if dst == SERVER
                else (self._node_download[dst] if self._node_download else math.inf))
        w = min(w, up, down)
        return a + (nbytes / w if math.isfinite(w) else 0.0)

    def duration(self, op: str, nbytes: int, ranks: Sequence[int]) -> float:
        """Seconds the collective `op` on `nbytes` takes for the group `ranks` (formulas in the module doc)."""
        r = len(ranks)
        if r <= 1:
            return 0.0
        w, a = self.link(ranks)
        n_over_w = nbytes / w if math.isfinite(w) else 0.0
        if self.topology == "tree":
            hops = math.ceil(math.log2(r))
            per_hop = a if op == "barrier" else n_over_w + a
            return (2 if op == "all_reduce" else 1) * hops * per_hop
        if op == "barrier":
            return a
        if self.topology == "ps":
            return (2 * (r - 1) * n_over_w + 2 * a) if op == "all_reduce" else (r - 1) * n_over_w + a
        shares = {"all_reduce": 2 * (r - 1) / r, "reduce_scatter": (r - 1) / r, "all_gather": (r - 1) / r,
                  "broadcast": 1.0}
        if op not in shares:
            raise ValueError(f"no time model for collective {op!r}; known: {sorted(shares) + ['barrier']}")
        return shares[op] * n_over_w + a


# The archetypes of the DiLoCo scaling-laws paper (arXiv 2503.09799) and a home connection.
PRESETS: dict[str, dict] = {
    "high": {"bandwidth": "400Gbps", "latency": "0.1ms"},
    "medium": {"bandwidth": "100Gbps", "latency": "1ms"},
    "low": {"bandwidth": "10Gbps", "latency": "10ms"},
    "home": {"bandwidth": "100Mbps", "latency": "30ms"},
    "ideal": {"bandwidth": "inf", "latency": 0.0},
}
