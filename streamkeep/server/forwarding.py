"""The cluster's front door: which member a request belongs to, and the views that span members.

Any member takes any request. One for a stream another member owns is forwarded there (or refused
with 421 when there is no cluster secret to forward with); `/stats?cluster=1` and the stream
browser's list gather every member's own answer.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

from streamkeep.cluster.forward import STATS_SECONDS, Forwarder, as_the_client_sent, forwarded_by
from streamkeep.cluster.peers import PeerOps, Peers
from streamkeep.cluster.placement import Member, Placement
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Request, Response
from streamkeep.protocol.responses import json_response
from streamkeep.protocol.routes import Route
from streamkeep.server import admin


def stale_placement(why: str) -> ProtocolError:
    return ProtocolError(
        503, "stale_placement", f"{why}; retry once the cluster agrees on its members", [("Retry-After", "1")]
    )


def _member_stats(answer: Response | None) -> dict[str, Any]:
    """Another member's /stats as /stats?cluster=1 lists it: its own, or why it is missing."""
    if answer is None:
        return {"error": "unreachable: no answer"}
    if answer.status != 200 or not isinstance(answer.body, bytes):
        return {"error": f"answered {answer.status}"}
    return dict(json.loads(answer.body))


class FrontDoor:
    """This member's place in its cluster and the calls that cross members."""

    def __init__(
        self,
        placement: Placement,
        member_id: str,
        secret: str,
        *,
        forwarder: Forwarder | None = None,
        peers: Peers | None = None,
        peer_ops: PeerOps | None = None,
    ) -> None:
        self.placement = placement
        self.member_id = member_id
        self.secret = secret
        self.forwarder = forwarder  # None: refuse strangers' streams instead (421)
        # Calls to the other members (forks of their streams, subscriptions, the registry), and
        # the operations this member answers for them; peers is None without a cluster secret.
        self.peers = peers
        self.peer_ops = PeerOps() if peer_ops is None else peer_ops
        self.client_http_versions: Counter[str] = Counter()  # what clients spoke to the front door

    def owner_elsewhere(self, route: Route, request: Request) -> Member | None:
        """The member to forward to if another one owns the stream (None: it is ours).

        Refuses what must not be served here: a request routed under another placement epoch, or
        forwarded to us by a member that thinks we own a stream we do not (maps that disagree must
        never make two owners), and, without a cluster secret to forward with, a stranger's stream."""
        placement = self.placement
        by = forwarded_by(request, self.secret, placement.members)
        as_the_client_sent(request, by)
        if by is None:
            version = request.headers.get("streamkeep-client-http-version")
            if version is not None:  # set by the front door (haproxy.py); a few known values only
                self.client_http_versions[
                    version if version in ("1.0", "1.1", "2.0", "3.0") else "other"
                ] += 1
        if route.name is None:
            return None
        epoch = request.headers.get("streamkeep-placement-epoch")
        if epoch is not None and epoch != str(placement.epoch):
            raise stale_placement(
                f"the request was routed by placement epoch {epoch[:20]}, this member runs {placement.epoch}"
            )
        owner = placement.owner(route.name)
        if owner.id != self.member_id:
            if by is not None:
                raise stale_placement(f"member {by!r} forwarded a stream that member {owner.id!r} owns")
            if self.forwarder is None:
                raise ProtocolError(
                    421,
                    "not_owner",
                    f"stream {route.name[:200]!r} belongs to cluster member {owner.id!r}, this is "
                    f"{self.member_id!r}; send it through the load balancer",
                    [("Streamkeep-Owner", owner.id)],
                )
            return owner
        if (
            self.peers is None
            and route.fork_source is not None
            and placement.owner(route.fork_source).id != self.member_id
        ):
            raise ProtocolError(
                409,
                "fork_across_members",
                f"the fork source {route.fork_source[:200]!r} lives on cluster member "
                f"{placement.owner(route.fork_source).id!r}; forks across members need a cluster secret",
            )
        return None

    async def answer_member(self, request: Request, refusal: ProtocolError | None) -> Response:
        """A call from another member (`/_cluster/<op>`)."""
        return await self.peer_ops.answer(request, self.placement, self.secret, refusal)

    def _others(self) -> list[Member]:
        return [m for m in self.placement.members if m.id != self.member_id]

    async def cluster_stats(self, request: Request, mine: Callable[[], dict[str, object]]) -> Response:
        """`/stats?cluster=1`: every member's /stats side by side, and their sum of the counts that
        add up; a member that does not answer is listed as unreachable."""
        assert self.forwarder is not None
        answers = await self.forwarder.gather(request, self._others(), STATS_SECONDS)
        views = {member: _member_stats(answer) for member, answer in answers.items()}
        views[self.member_id] = mine()
        totals = {
            key: sum(view.get(key, 0) for view in views.values() if isinstance(view.get(key), int))
            for key in ("streams", "stored_bytes", "actors_active", "live_readers")
        }
        body = {
            "members": views,
            "totals": totals,
            "reachable": sum("error" not in v for v in views.values()),
        }
        return json_response(200, body)

    async def cluster_streams(self, request: Request, mine: Response) -> Response:
        """The stream browser's list in a cluster: every member's own list (each filtered by the
        caller's token on that member), merged by name; a member that does not answer is named."""
        assert self.forwarder is not None
        answers = await self.forwarder.gather(request, self._others())
        return admin.merged(self.member_id, json.loads(mine.body), answers, admin.parse_limit(request))

    def stats(self) -> dict[str, object]:
        """This member's place in its cluster, for /stats (each member reports its own streams)."""
        placement = self.placement
        return {
            "member": self.member_id,
            "epoch": placement.epoch,
            "members": {
                m.id: {"address": m.address, "slots": placement.slots_of(m.id)} for m in placement.members
            },
            "forwarding": self.forwarder is not None,
            "forwarded_requests": 0 if self.forwarder is None else self.forwarder.forwarded,
            "requests_by_client_http_version": dict(self.client_http_versions),
            "calls_to_members": None if self.peers is None else self.peers.stats(),
            "calls_from_members": {"answered": self.peer_ops.calls, "refused": self.peer_ops.refused},
        }


__all__ = ["FrontDoor", "stale_placement"]
