"""The network model: the links of a cluster, the routes transfers take over them, and how long a transfer takes alone.

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
cluster's bandwidth and latency). With server_datacenter=d the server sits in datacenter d, and a node elsewhere
reaches it over the link between datacenters as well.

Links and routes (exogym.cluster.flows shares them): every transfer crosses a route of directed links, each
direction of a link its own capacity (full duplex): "up" is what the endpoint (a node, the server) sends, "down" what
it receives. A link of infinite capacity is left out of every route.

    port i up/down      node i's port on its datacenter's network: `bandwidth` (routes between nodes, collectives)
    nic i up/down       node i's own cap, node_bandwidth[i] (every route of node i)
    access i up/down    node i's connection for messages: node_upload[i] / node_download[i]
    server up/down      the server's link: server_bandwidth capped by server_upload / server_download
    wan a>b             from datacenter a to datacenter b: inter_bandwidth

A route's bandwidth alone is the least capacity on it, which is exactly the W of the formulas above; a
collective occupies the ports and nics of its members and the links between datacenters its algorithm crosses
(ring: between neighbours in rank order, wrapping; tree: a binary tree in rank order; ps: from ranks[0] to each
member), each with the bytes its formula counts (ring all-reduce 2 N (R-1)/R, tree 2 log2(R) N, ps 2 (R-1) N, ...).
With shared_links (the default) the sim's transfers in flight at once (messages, and in one process its
collectives) share their links max-min fairly; with shared_links=False every transfer runs alone at W.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Sequence

__all__ = ["Network", "Route", "parse_bandwidth", "parse_seconds", "PRESETS", "TOPOLOGIES", "SERVER"]

SERVER = -1  # the rank of a strategy's server in the network model and in messages (it sorts before every node)

TOPOLOGIES = ("ring", "tree", "ps")

_BW_UNITS = {"bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
             "b/s": 8, "kb/s": 8e3, "mb/s": 8e6, "gb/s": 8e9, "tb/s": 8e12}  # bits/s (bytes/s for B/s)
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"


def parse_bandwidth(value: float | str, name: str = "bandwidth") -> float:
    """Bytes per second from a number of bits/s (`1e9`) or a string: `"1Gbps"`, `"400 Gbit/s"`, `"100MB/s"`, `"inf"`.

    Args:
        value: The bandwidth.
        name: The argument's name, for the error message.

    Returns:
        Bytes per second.

    Raises:
        ValueError: An unreadable or non-positive bandwidth.
        TypeError: Neither a number nor a string.
    """
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
    """Seconds from a number (`0.02`) or a string: `"20ms"`, `"100us"`, `"0.1 s"`.

    Args:
        value: The duration.
        name: The argument's name, for the error message.

    Returns:
        The seconds.

    Raises:
        ValueError: An unreadable or negative duration.
        TypeError: Neither a number nor a string.
    """
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
class Route:
    """Where a transfer goes: the directed links it crosses and what it puts on them.

    Args:
        links: The names of the directed links crossed (each once; infinite ones left out), e.g. `"port 3 up"`.
        capacities: Each link's capacity in bytes/s.
        nbytes: The bytes the transfer puts on each of its links.
        latency: The seconds added after the last byte is sent.
        seconds: The formula's seconds for the transfer alone on its route, latency included (the module doc).
    """

    links: tuple[str, ...]
    capacities: tuple[float, ...]
    nbytes: float
    latency: float
    seconds: float


@dataclass(frozen=True, repr=False)
class Network:
    """A cluster's links: how long each collective takes, for simulated time.

    Bandwidths take bits/s numbers or strings (`"1Gbps"`); latencies seconds or `"20ms"`. The formulas per
    collective and topology are in the guide's [simulated time](../guide.md#simulated-time) and in the module
    `exogym.cluster.network`. Presets: `Network.preset("high")` (or `fit(network="high")`).

    Args:
        bandwidth: The links' bandwidth (inside a datacenter).
        latency: The links' latency (inside a datacenter).
        topology: How collectives run: `"ring"`, `"tree"` or `"ps"` (a parameter server).
        datacenters: Lists of ranks that share fast links (`bandwidth` / `latency`); between datacenters the
            links run at `inter_bandwidth` / `inter_latency`. Default: one datacenter.
        inter_bandwidth: The bandwidth between datacenters (needed with `datacenters`).
        inter_latency: The latency between datacenters (needed with `datacenters`).
        node_bandwidth: Optional per-rank caps (a node on a slow uplink slows every group it is in).
        node_upload: Optional per-rank caps on what a node sends in point-to-point messages (a home
            connection: `node_upload=["10Mbps"] * K`, `node_download=["100Mbps"] * K`).
        node_download: Optional per-rank caps on what a node receives in point-to-point messages.
        server_bandwidth: The server's link (default: `bandwidth`).
        server_latency: The server's latency (default: `latency`).
        server_upload: A cap on what the server sends.
        server_download: A cap on what the server receives.
        server_datacenter: The datacenter the server sits in (default: none, every node reaches it directly); a
            node in another one reaches it over the link between datacenters too.
        shared_links: Whether transfers in flight at once (messages; collectives in one process) share the links
            they cross (max-min fair, module doc); False: each runs alone at its route's bandwidth, as if no other
            transfer were there.

    Raises:
        ValueError: An unknown topology, an unreadable bandwidth or latency, `datacenters` that do not
            partition the ranks 0..K-1, or inter-datacenter links without datacenters (or the reverse).
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
    server_datacenter: int | None = None
    shared_links: bool = True

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
        if not isinstance(self.shared_links, bool):
            raise TypeError(f"shared_links must be True or False, got {self.shared_links!r}")
        if self.server_datacenter is not None:
            if self.datacenters is None:
                raise ValueError("server_datacenter only means something with datacenters=[[...], [...]]")
            if isinstance(self.server_datacenter, bool) or not isinstance(self.server_datacenter, int) \
                    or not 0 <= self.server_datacenter < len(self.datacenters):
                raise ValueError(f"server_datacenter must be the index of one of the {len(self.datacenters)} "
                                 f"datacenters (0..{len(self.datacenters) - 1}), got {self.server_datacenter!r}")

    def __repr__(self) -> str:
        # the fields added with shared links are shown only when set, so a run's config.json and the fingerprint its
        # checkpoints carry read as they did for every network that does not set them
        shown = [f for f in fields(self) if not (f.name == "server_datacenter" and self.server_datacenter is None
                                                 or f.name == "shared_links" and self.shared_links)]
        return f"Network({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    @classmethod
    def preset(cls, name: str, **overrides) -> "Network":
        """A named network: `"high"` (400 Gbit/s, 0.1 ms), `"medium"`, `"low"`, `"home"`, `"ideal"`.

        Args:
            name: The preset's name.
            **overrides (Any): Fields to change (e.g. `topology="tree"`).

        Returns:
            The Network.

        Raises:
            ValueError: An unknown preset (listing the known ones).
        """
        try:
            return cls(**{**PRESETS[name], **overrides})
        except KeyError:
            raise ValueError(f"unknown network preset {name!r}; choose one of {sorted(PRESETS)}") from None

    def check_nodes(self, num_nodes: int) -> None:
        """Raise if the description does not fit a run of `num_nodes` nodes.

        Args:
            num_nodes: The run's node count.

        Raises:
            ValueError: `datacenters` or `node_bandwidth` cover another number of ranks.
        """
        if self.datacenters is not None and len(self._dc) != num_nodes:
            raise ValueError(f"datacenters cover {len(self._dc)} ranks but the run has num_nodes={num_nodes}")
        if self._caps is not None and len(self._caps) != num_nodes:
            raise ValueError(f"node_bandwidth has {len(self._caps)} entries but the run has num_nodes={num_nodes}")
        for name in ("node_upload", "node_download"):
            caps = getattr(self, f"_{name}")
            if caps is not None and len(caps) != num_nodes:
                raise ValueError(f"{name} has {len(caps)} entries but the run has num_nodes={num_nodes}")

    def link(self, ranks: Sequence[int]) -> tuple[float, float]:
        """The slowest link a group of these ranks uses.

        Args:
            ranks: The group's ranks.

        Returns:
            `(bytes/s, latency in s)`.
        """
        w, a = self._w, self._a
        if self.datacenters is not None and len({self._dc[r] for r in ranks}) > 1:
            w, a = min(w, self._inter_w), max(a, self._inter_a)
        if self._caps is not None:
            w = min([w] + [self._caps[r] for r in ranks])
        return w, a

    def _message_link(self, src: int, dst: int) -> tuple[float, float]:
        """The (bytes/s, latency) of a message from `src` to `dst` (not to itself): the module doc's formula."""
        if SERVER in (src, dst):
            w, a = self._server_w, self._server_a
            node = dst if src == SERVER else src
            if self._caps is not None:
                w = min(w, self._caps[node])
            if self.server_datacenter is not None and self._dc[node] != self.server_datacenter:
                w, a = min(w, self._inter_w), max(a, self._inter_a)
        else:
            w, a = self.link((src, dst))
        up = self._server_upload if src == SERVER else (self._node_upload[src] if self._node_upload else math.inf)
        down = (self._server_download if dst == SERVER
                else (self._node_download[dst] if self._node_download else math.inf))
        return min(w, up, down), a

    def message_seconds(self, nbytes: int, src: int, dst: int) -> float:
        """Seconds a point-to-point message takes alone on its route: latency + nbytes / W.

        W is the smallest of the link's bandwidth, the sender's upload cap and the receiver's download cap.

        Args:
            nbytes: The message's bytes.
            src: The sender: a node's rank, or SERVER.
            dst: The receiver: a node's rank, or SERVER.

        Returns:
            The seconds (0 from a node to itself).
        """
        if src == dst:
            return 0.0
        w, a = self._message_link(src, dst)
        return a + (nbytes / w if math.isfinite(w) else 0.0)

    def message_route(self, nbytes: int, src: int, dst: int) -> Route:
        """The route of a message (module doc): the sender's links, the link between datacenters if it crosses one,
        the receiver's links.

        Args:
            nbytes: The message's bytes.
            src: The sender: a node's rank, or SERVER.
            dst: The receiver: a node's rank, or SERVER.

        Returns:
            The Route (no links from a node to itself); alone on it the message takes `message_seconds`.
        """
        if src == dst:
            return Route((), (), nbytes, 0.0, 0.0)
        if src == SERVER:
            links = self._server_links("up") + self._wan(self.server_datacenter, self._dc_of(dst)) \
                + self._node_links(dst, "down", port=False)
        elif dst == SERVER:
            links = self._node_links(src, "up", port=False) + self._wan(self._dc_of(src), self.server_datacenter) \
                + self._server_links("down")
        else:
            links = self._node_links(src, "up", port=True) + self._wan(self._dc_of(src), self._dc_of(dst)) \
                + self._node_links(dst, "down", port=True)
        return _route(links, nbytes, self._message_link(src, dst)[1], self.message_seconds(nbytes, src, dst))

    def collective_route(self, op: str, nbytes: int, ranks: Sequence[int]) -> Route:
        """The links a collective occupies and the bytes its formula puts on each (module doc).

        Args:
            op: `"all_reduce"`, `"reduce_scatter"`, `"all_gather"`, `"broadcast"` or `"barrier"`.
            nbytes: The payload N (the full tensor; for all-gather the gathered output).
            ranks: The group's ranks.

        Returns:
            The Route; alone on it the collective takes `duration`.
        """
        seconds = self.duration(op, nbytes, ranks)
        r = len(ranks)
        if r <= 1:
            return Route((), (), 0, 0.0, 0.0)
        _, a = self.link(ranks)
        if self.topology == "tree":
            passes = (2 if op == "all_reduce" else 1) * math.ceil(math.log2(r))
            volume, latency = (0 if op == "barrier" else passes * nbytes), passes * a
            edges = [(ranks[(p - 1) // 2], ranks[p]) for p in range(1, r)]
            edges += [(b, a_) for a_, b in edges]
        elif op == "barrier":
            volume, latency, edges = 0, a, []
        elif self.topology == "ps":
            passes = 2 if op == "all_reduce" else 1
            volume, latency = passes * (r - 1) * nbytes, passes * a
            edges = [(ranks[0], m) for m in ranks[1:]] + [(m, ranks[0]) for m in ranks[1:]]
        else:
            shares = {"all_reduce": 2 * (r - 1) / r, "reduce_scatter": (r - 1) / r, "all_gather": (r - 1) / r,
                      "broadcast": 1.0}
            volume, latency = shares[op] * nbytes, a
            edges = [(ranks[i], ranks[(i + 1) % r]) for i in range(r)]
        links = [link for m in ranks for d in ("up", "down") for link in self._node_links(m, d, port=True,
                                                                                         access=False)]
        for x, y in edges:
            links += self._wan(self._dc_of(x), self._dc_of(y))
        return _route(links, volume, latency, seconds)

    def _dc_of(self, rank: int) -> int | None:
        return None if self.datacenters is None else self._dc[rank]

    def _node_links(self, rank: int, direction: str, *, port: bool, access: bool = True) -> list[tuple[str, float]]:
        links = [(f"port {rank} {direction}", self._w)] if port else []
        if self._caps is not None:
            links.append((f"nic {rank} {direction}", self._caps[rank]))
        caps = self._node_upload if direction == "up" else self._node_download
        if access and caps is not None:
            links.append((f"access {rank} {direction}", caps[rank]))
        return links

    def _server_links(self, direction: str) -> list[tuple[str, float]]:
        cap = self._server_upload if direction == "up" else self._server_download
        return [(f"server {direction}", min(self._server_w, cap))]

    def _wan(self, a: int | None, b: int | None) -> list[tuple[str, float]]:
        return [] if a is None or b is None or a == b else [(f"wan {a}>{b}", self._inter_w)]

    def duration(self, op: str, nbytes: int, ranks: Sequence[int]) -> float:
        """Seconds the collective `op` on `nbytes` takes for the group `ranks` (formulas in the module doc).

        Args:
            op: `"all_reduce"`, `"reduce_scatter"`, `"all_gather"`, `"broadcast"` or `"barrier"`.
            nbytes: The payload N (the full tensor; for all-gather the gathered output).
            ranks: The group's ranks (one rank: 0 s).

        Returns:
            The seconds.
        """
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


def _route(links: list[tuple[str, float]], nbytes: float, latency: float, seconds: float) -> Route:
    """A Route over `links` (name, capacity): each link once, the infinite ones left out."""
    kept = dict(link for link in links if math.isfinite(link[1]))
    return Route(tuple(kept), tuple(kept.values()), nbytes, latency, seconds)


# The archetypes of the DiLoCo scaling-laws paper (arXiv 2503.09799) and a home connection.
PRESETS: dict[str, dict] = {
    "high": {"bandwidth": "400Gbps", "latency": "0.1ms"},
    "medium": {"bandwidth": "100Gbps", "latency": "1ms"},
    "low": {"bandwidth": "10Gbps", "latency": "10ms"},
    "home": {"bandwidth": "100Mbps", "latency": "30ms"},
    "ideal": {"bandwidth": "inf", "latency": 0.0},
}
