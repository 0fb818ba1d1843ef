"""`streamkeep cluster resize --data-dir DIR --processes N`: add or remove members of a stopped
`cluster run` cluster, moving every stream whose owner changes (docs/scaling.md §9).

Streams never move as a side effect; this is the explicit operation. It works on the layout
`cluster run` keeps on one machine (`DIR/m0`, `DIR/m1`, ... and `DIR/cluster.toml`), with every
member stopped cleanly (no `RUNNING` marker: a member that crashed is started and stopped once
first, so its data is recovered and synced). The new placement is the rendezvous hash over the
new member list at the next epoch, so growing from N to N+1 moves only the ~1/(N+1) of the slots
the newcomer wins, all to it; shrinking moves only the leaving members' streams.

Crash safety: the plan (old and new members, epoch) is written to `DIR/resize.json` first, and
`cluster run` refuses to start while it is there. Each stream directory moves with one rename
(it is in exactly one member at every instant), then the fork pins are put right, then
`cluster.toml` is rewritten and the plan removed. Running the command again after an
interruption finishes the same plan: every step looks at where things are, not at what it did.

Forks: a fork and its source hash independently. A pair that ends up on two members needs a pin
on the source (written here, with the fork's lowest readable position and the source chain's
incarnations in the fork's meta, as `fork.attach` would), and a pair that ends up together
needs none (the local count, from the fork's `from`, takes over). Subscription state lives in
each member's `subscriptions/` directory and moves to the member owning the subscription's id.
The bucket needs nothing: its keys are per stream and incarnation, never per member.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from streamkeep.cluster.placement import Member, Placement, slot
from streamkeep.cluster.run import recorded, write_toml
from streamkeep.protocol.stream import StreamMeta
from streamkeep.segments import layout
from streamkeep.storage import files
from streamkeep.storage.disk import manifest
from streamkeep.storage.disk.directory import RUNNING, DataDirectory
from streamkeep.storage.disk.meta import decode_meta, encode_meta
from streamkeep.subscriptions.store import SUFFIX as SUBSCRIPTION_SUFFIX

PLAN = "resize.json"
SUBSCRIPTIONS = "subscriptions"


class ResizeError(Exception):
    """What must be fixed before the cluster can be resized, said so a person can."""


@dataclass
class Stream:
    meta: StreamMeta
    directory: Path  # where it is now

    @property
    def member(self) -> str:
        return self.directory.parent.parent.name


@dataclass
class Report:
    moved: dict[str, int]
    subscriptions_moved: int = 0
    pins_added: int = 0
    pins_dropped: int = 0


def placement_of(ids: list[str], epoch: int) -> Placement:
    return Placement.of([Member(member_id, "127.0.0.1:1") for member_id in ids], epoch)


def resize(data_dir: Path, processes: int, *, say: Callable[[str], None] = print) -> Report:
    if processes < 1:
        raise ResizeError("--processes must be at least 1")
    if any(data_dir.glob("m*a/replica.json")) or any(data_dir.glob("m*b/replica.json")):
        raise ResizeError(
            f"{data_dir} is a replicated cluster (--replicas 2): resizing one is not built; its streams "
            "would move on one replica and not the other"
        )
    plan_path = data_dir / PLAN
    if plan_path.exists():  # an interrupted resize: finish that one
        plan = json.loads(plan_path.read_text())
        old, new, epoch = plan["from"], plan["to"], plan["epoch"]
        if len(new) != processes:
            raise ResizeError(
                f"{plan_path}: a resize to {len(new)} processes was interrupted; run it again with "
                f"--processes {len(new)} to finish it first"
            )
        say(f"finishing the interrupted resize to {len(new)} processes (epoch {epoch})")
    else:
        old, current_epoch = recorded(data_dir)
        if not old:
            raise ResizeError(
                f"{data_dir / 'cluster.toml'} is missing: {data_dir} is not a `streamkeep cluster run` directory"
            )
        new, epoch = [f"m{i}" for i in range(processes)], current_epoch + 1
        if new == old:
            raise ResizeError(f"{data_dir} already has {processes} processes")
        for member_id in old:
            if (data_dir / member_id / RUNNING).exists():
                raise ResizeError(
                    f"member {member_id} is running or did not stop cleanly ({data_dir / member_id / RUNNING}); "
                    "stop the cluster with Ctrl-C (after a crash: start it once and stop it) and run this again"
                )
        files.replace(files.OS, data_dir, PLAN, json.dumps({"from": old, "to": new, "epoch": epoch}).encode())
    target = placement_of(new, epoch)
    for member_id in new:
        directory = DataDirectory(files.OS, data_dir / member_id)
        directory.open()  # FORMAT, streams/, trash/ for a newcomer
    streams = _streams(data_dir, sorted(set(old) | set(new)))
    report = Report(moved={member_id: 0 for member_id in new})
    for stream in streams.values():
        owner = target.owner(stream.meta.name).id
        if stream.member != owner:
            destination = data_dir / owner / layout.STREAMS / stream.directory.name
            if destination.exists():
                raise ResizeError(
                    f"{stream.meta.name!r} is in both {stream.directory} and {destination}; keep one"
                )
            os.rename(stream.directory, destination)
            files.fsync_dir(files.OS, stream.directory.parent)
            files.fsync_dir(files.OS, destination.parent)
            stream.directory = destination
            report.moved[owner] += 1
    report.subscriptions_moved = _move_subscriptions(data_dir, old, new, target)
    _fix_pins(streams, target, report)
    write_toml(data_dir / "cluster.toml", [Member(m, "127.0.0.1:1") for m in new], epoch)
    plan_path.unlink()
    files.fsync_dir(files.OS, data_dir)
    for member_id in sorted(set(old) - set(new)):
        left = data_dir / member_id / layout.STREAMS
        if left.is_dir() and not any(left.iterdir()):
            say(f"member {member_id} left the cluster; {data_dir / member_id} holds no streams now")
    say(
        f"resized to {processes} processes (placement epoch {epoch}): "
        + ", ".join(f"{count} streams to {member}" for member, count in report.moved.items() if count)
        + (f"; {report.subscriptions_moved} subscriptions moved" if report.subscriptions_moved else "")
        + f"; fork pins: {report.pins_added} added, {report.pins_dropped} dropped"
    )
    return report


def _streams(data_dir: Path, members: list[str]) -> dict[str, Stream]:
    found: dict[str, Stream] = {}
    for member_id in members:
        root = data_dir / member_id / layout.STREAMS
        if not root.is_dir():
            continue
        for directory in sorted(root.iterdir()):
            meta_path = directory / layout.META
            if directory.name.startswith(".") or not meta_path.exists():
                continue  # a create a crash interrupted: the member's own start cleans it up
            meta = decode_meta(meta_path.read_bytes())
            if meta.name in found:
                raise ResizeError(
                    f"{meta.name!r} is in both {found[meta.name].directory} and {directory}; keep one"
                )
            found[meta.name] = Stream(meta, directory)
    return found


def _held_from(stream: Stream) -> int:
    """The first position whose bytes the stream still holds itself (local or in the bucket)."""
    starts = [layout.segment_start(p.name) for p in stream.directory.glob("*" + layout.SEGMENT_SUFFIX)]
    starts += [
        layout.segment_start(entry["file"]) for entry in manifest.load_manifest(files.OS, stream.directory)
    ]
    return min(starts, default=stream.meta.fork_base)


def _held_low(streams: dict[str, Stream], stream: Stream) -> int:
    own = _held_from(stream)
    meta = stream.meta
    source = streams.get(meta.forked_from or "")
    if source is not None and own <= meta.fork_base:
        return min(_held_low(streams, source), meta.fork_base)
    return own


def _incarnations(streams: dict[str, Stream], meta: StreamMeta) -> tuple[int, ...]:
    found: list[int] = []
    while meta.forked_from is not None:
        source = streams.get(meta.forked_from)
        if source is None:
            return (*found, *meta.source_incarnations)
        meta = source.meta
        found.append(meta.incarnation)
    return tuple(found)


def _fix_pins(streams: dict[str, Stream], target: Placement, report: Report) -> None:
    """Pins for fork pairs that end up apart, none for pairs that end up together. The fork's
    meta is written before its source's pin: a rerun after a crash between the two sees no pin
    and writes both again, where the other order would leave the fork without what it needs."""
    for fork in streams.values():
        source = streams.get(fork.meta.forked_from or "")
        if source is None:
            continue  # its source is gone: nothing to hold for it
        apart = target.owner(fork.meta.name).id != target.owner(source.meta.name).id
        pins = source.meta.remote_forks
        pin = next((p for p in pins if p[0] == fork.meta.stream_id), None)
        if apart and pin is None:
            low = min(_held_low(streams, source), fork.meta.fork_base)
            incarnations = _incarnations(streams, fork.meta)
            _write(
                streams, fork.meta.name, replace(fork.meta, fork_low=low, source_incarnations=incarnations)
            )
            pinned = (*pins, (fork.meta.stream_id, fork.meta.name, low))
            _write(streams, source.meta.name, replace(source.meta, remote_forks=pinned))
            report.pins_added += 1
        elif not apart and pin is not None:
            kept = tuple(p for p in pins if p[0] != fork.meta.stream_id)
            _write(streams, source.meta.name, replace(source.meta, remote_forks=kept))
            report.pins_dropped += 1


def _write(streams: dict[str, Stream], name: str, meta: StreamMeta) -> None:
    files.replace(files.OS, streams[name].directory, layout.META, encode_meta(meta))
    streams[name].meta = meta


def _move_subscriptions(data_dir: Path, old: list[str], new: list[str], target: Placement) -> int:
    """Each subscription's saved state to the member that owns its id now (HAProxy routes its
    control requests by the slot of the id alone, not of a stream path)."""
    moved = 0
    for member_id in sorted(set(old) | set(new)):
        root = data_dir / member_id / SUBSCRIPTIONS
        if not root.is_dir():
            continue
        for entry in sorted(root.glob("*" + SUBSCRIPTION_SUFFIX)):
            owner = target.owner_of_slot(slot(entry.name[: -len(SUBSCRIPTION_SUFFIX)])).id
            if owner == member_id:
                continue
            destination = data_dir / owner / SUBSCRIPTIONS
            files.makedirs(files.OS, destination)
            os.rename(entry, destination / entry.name)
            files.fsync_dir(files.OS, root)
            files.fsync_dir(files.OS, destination)
            moved += 1
    return moved
