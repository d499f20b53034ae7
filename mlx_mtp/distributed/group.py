"""The control plane of an `mlx.launch` group: rank 0 reaches every other rank over a TCP
connection that carries host messages (JSON), every process hears from its peers every second,
and a watchdog ends a process whose peer is gone instead of letting it wait forever.

No tensor travels here: activations, drafts and each round's decision go rank to rank with
`mx.distributed` inside every rank's lazy graph (`pipeline.py`). Only what rank 0 decides on the
host (the generator calls it makes, each round's draft length) is sent on these connections.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import secrets
import socket
import struct
import sys
import threading
import time
from typing import NoReturn, Optional

import mlx.core as mx

EXIT_PEER_LOST = 70  # the exit status of a rank stopped by its watchdog


class GroupError(RuntimeError):
    """The processes of a group cannot work together (setup, or a message out of order)."""


@dataclasses.dataclass
class Traffic:
    """What a rank sent: messages and bytes (and, for the device, decisions shared)."""

    messages: int = 0
    bytes: int = 0
    decisions: int = 0


def launched() -> Optional["Group"]:
    """This process's group when `mlx.launch` started more than one rank, else None."""
    if "MLX_RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        return None  # not launched as a group: leave mx.distributed alone
    world = mx.distributed.init()
    return Group(world) if world.size() > 1 else None


def _seconds(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


class Group:
    """One process of an `mlx.launch` group, connected to its peers.

    Rank 0 (the leader) talks to every other rank; the others talk to rank 0 only. A peer
    whose connection closes, that says it failed, or that is silent for `MLX_MTP_PEER_TIMEOUT`
    seconds (default 20) stops this process with a message naming it; so does a step that has
    not finished after `MLX_MTP_STEP_TIMEOUT` seconds (default 600): the group is stuck.
    """

    def __init__(self, world: mx.distributed.Group, connect_timeout: float = 120.0):
        self.world = world
        self.rank, self.size = world.rank(), world.size()
        self.leader = self.rank == 0
        self.peer_timeout = _seconds("MLX_MTP_PEER_TIMEOUT", 20)
        self.step_timeout = _seconds("MLX_MTP_STEP_TIMEOUT", 600)
        self.busy_since: Optional[float] = None  # when the step now running began
        self.inbox: queue.Queue = queue.Queue()  # rank 0's messages, on the other ranks
        self.peers: dict[int, _Peer] = {}
        self.sent = Traffic()  # host messages (heartbeats aside)
        self._closing = False
        self._failing = threading.Lock()
        _one_launch(world)
        self.secret = self._connect(connect_timeout)
        for rank, peer in self.peers.items():
            name = f"mlx_mtp-rank{rank}"
            threading.Thread(target=self._listen, args=(rank, peer), name=name, daemon=True).start()
        threading.Thread(target=self._watch, name="mlx_mtp-watchdog", daemon=True).start()

    # ---- messages -------------------------------------------------------------------------

    def send(self, message: dict) -> None:
        """Rank 0: send `message` to every other rank."""
        for rank, peer in self.peers.items():
            try:
                self.sent.bytes += peer.write(message)
            except OSError as e:
                self.fail(f"cannot reach rank {rank} ({e})")
            self.sent.messages += 1

    def receive(self) -> dict:
        """The other ranks: rank 0's next message (waits for it)."""
        return self.inbox.get()

    def close(self) -> None:
        """End this process's part: rank 0 tells the others to exit; the others wait for that."""
        if self.leader:
            self._closing = True
            self.send({"call": "exit"})
        else:
            message = self.receive()
            if message.get("call") != "exit":
                raise GroupError(f"rank 0 still had work for this rank: {message.get('call')!r}")
            self._closing = True
        for peer in self.peers.values():
            peer.close()

    def fail(self, reason: str) -> NoReturn:
        """Stop this process now: say why (here and to the peers) and exit. The main thread may be
        waiting inside MLX for a peer that will never answer, so nothing less would do."""
        with self._failing:
            where = f"mlx_mtp pipeline, rank {self.rank} of {self.size}"
            print(f"{where}: {reason}; stopping", file=sys.stderr, flush=True)
            for peer in self.peers.values():
                peer.write({"error": reason}, block=False)
            os._exit(EXIT_PEER_LOST)

    # ---- setup ----------------------------------------------------------------------------

    def _connect(self, timeout: float) -> int:
        """Rank 0 listens on an ephemeral port; port and a shared secret reach the others through
        one `all_sum`; they connect and prove they belong to the group with the secret."""
        host = leader_host()
        server, port, secret = None, 0, 0
        if self.leader:
            server = socket.create_server((host, 0))
            server.settimeout(timeout)
            port, secret = server.getsockname()[1], secrets.randbits(30)
        shared = mx.distributed.all_sum(mx.array([port, secret], dtype=mx.int32), group=self.world)
        port, secret = (int(v) for v in shared.tolist())
        if not self.leader:
            self.peers[0] = _Peer(socket.create_connection((host, port), timeout=timeout))
            self.peers[0].write({"rank": self.rank, "secret": secret})
            return secret
        try:
            while len(self.peers) < self.size - 1:
                peer = _Peer(server.accept()[0])
                rank = self._hello(peer, secret, timeout)
                if rank is None:
                    peer.close()  # not one of ours
                else:
                    self.peers[rank] = peer
        except socket.timeout:
            missing = sorted(set(range(1, self.size)) - set(self.peers))
            raise GroupError(f"ranks {missing} did not reach rank 0 at {host}:{port} within {timeout:.0f} s")
        finally:
            server.close()
        return secret

    def _hello(self, peer: "_Peer", secret: int, timeout: float) -> Optional[int]:
        """The rank a new connection says it is, if it knows the group's secret."""
        peer.sock.settimeout(timeout)
        try:
            hello = peer.read()
        except (OSError, ValueError):
            return None
        peer.sock.settimeout(None)
        if not isinstance(hello, dict):
            return None
        rank = hello.get("rank")
        return rank if hello.get("secret") == secret and rank in range(1, self.size) else None

    # ---- background threads --------------------------------------------------------------------

    def _listen(self, rank: int, peer: "_Peer") -> None:
        while True:
            try:
                message = peer.read()
            except OSError as e:
                if self._closing:
                    return
                self.fail(f"lost the connection to rank {rank} ({e})")
            if message is None:
                if self._closing:
                    return
                self.fail(f"rank {rank} is gone (its connection closed)")
            peer.heard = time.monotonic()
            if "error" in message:
                self.fail(f"rank {rank} stopped: {message['error']}")
            elif "call" in message:
                self.inbox.put(message)
                if message["call"] == "exit":
                    return

    def _watch(self) -> None:
        beat = min(1.0, self.peer_timeout / 4)
        while not self._closing:
            time.sleep(beat)
            now = time.monotonic()
            for rank, peer in list(self.peers.items()):
                if self._closing:
                    return
                try:
                    peer.write({"beat": 1})
                except OSError as e:
                    self.fail(f"cannot reach rank {rank} ({e})")
                if now - peer.heard > self.peer_timeout:
                    self.fail(f"no word from rank {rank} for {now - peer.heard:.0f} s (MLX_MTP_PEER_TIMEOUT)")
            busy = self.busy_since
            if busy is not None and now - busy > self.step_timeout:
                self.fail(f"a generation step has not finished after {now - busy:.0f} s: the group is stuck "
                          "(MLX_MTP_STEP_TIMEOUT)")


def _one_launch(world: mx.distributed.Group) -> None:
    """On one machine (a loopback ring), every rank must have been started by the same process
    (`mlx.launch`, or a script's Popen): MLX's ring binds its ports with SO_REUSEPORT, so two groups
    started on the same ports are joined into each other's rings, silently, and each would then
    run its peer's steps. Ranks on other machines are ssh's children: not checked."""
    if not loopback(os.environ.get("MLX_HOSTFILE")):
        return
    mine = mx.array([os.getppid()], dtype=mx.int32)
    parents = set(mx.distributed.all_gather(mine, group=world).tolist())
    if len(parents) > 1:
        raise GroupError(f"the ranks of this ring were started by different processes ({sorted(parents)}): two "
                         "groups share its ports (MLX's ring lets them); start each on its own --starting-port")


def loopback(hostfile: Optional[str]) -> bool:
    """Whether a ring hostfile puts every rank on this machine's loopback address."""
    try:
        with open(hostfile) as f:
            hosts = [address.rsplit(":", 1)[0] for rank in json.load(f) for address in rank]
    except (OSError, TypeError, ValueError):
        return False
    return bool(hosts) and all(h in ("127.0.0.1", "localhost", "::1", "[::1]") for h in hosts)


def loopback_hostfile(path, ranks: int = 2):
    """Write a ring hostfile (as `mlx.launch` passes in MLX_HOSTFILE) for `ranks` processes on
    this machine, each on a free port; returns `path`."""
    ports = []
    for _ in range(ranks):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    with open(path, "w") as f:
        json.dump([[f"127.0.0.1:{p}"] for p in ports], f)
    return path


def leader_host() -> str:
    """Rank 0's address: MLX_MTP_LEADER, else the first host of the ring's hostfile or the jaccl
    coordinator that `mlx.launch` passes on, else this machine."""
    if os.environ.get("MLX_MTP_LEADER"):
        return os.environ["MLX_MTP_LEADER"]
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and os.path.exists(hostfile):
        with open(hostfile) as f:
            return json.load(f)[0][0].rsplit(":", 1)[0]
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    return "127.0.0.1"


class _Peer:
    """One connection: length-prefixed JSON messages; writes from several threads."""

    def __init__(self, sock: socket.socket):
        sock.settimeout(None)  # blocking: the watchdog, not a timeout, notices a silent peer
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.lock = threading.Lock()
        self.heard = time.monotonic()

    def write(self, message: dict, block: bool = True) -> int:
        """Send `message`; returns the bytes sent."""
        data = json.dumps(message).encode()
        frame = struct.pack(">I", len(data)) + data
        if not block:  # best effort, for a last word to a peer that may not be reading
            try:
                self.sock.send(frame, socket.MSG_DONTWAIT)
            except OSError:
                pass
            return 0
        with self.lock:
            self.sock.sendall(frame)
        return len(frame)

    def read(self) -> Optional[dict]:
        """The next message, or None when the peer closed the connection."""
        head = self._exactly(4)
        if head is None:
            return None
        body = self._exactly(struct.unpack(">I", head)[0])
        return None if body is None else json.loads(body)

    def _exactly(self, n: int) -> Optional[bytes]:
        chunks = []
        while n:
            chunk = self.sock.recv(n)
            if not chunk:
                return None
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
