"""What this host gives attempts, decided once when the agent starts (who they run as,
where their folders go, which cgroups hold them), and each attempt's preparation and
clean-up. See ``isolation`` for the layout and ``cgroups`` for the limits."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import resource
import time
from base64 import b64decode
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from libs.common import tracing
from libs.common.models import Assignment, Egress
from services.worker import firewall, outputs, progress, spawner, tmpfs
from services.worker.artifacts import (
    ArtifactCache,
    Sealed,
    Stamp,
    in_open_thread,
    open_as_here,
)
from services.worker.cgpool import CgroupPool, Slot
from services.worker.cgroups import AttemptCgroup, Cgroups
from services.worker.devices import denied
from services.worker.executor import (
    AttemptSpec,
    RunningAttempt,
    SourceChanged,
    SourceUnanswered,
    start_attempt,
    unanswered,
)
from services.worker.isolation import (
    OWN_TMP,
    Folders,
    Identity,
    Sandbox,
    UidPool,
    host_writable_folders,
    ipc_namespaces_work,
    kill_every_process_of,
    mount_namespaces_work,
    searchable_by_others,
)
from services.worker.settings import WorkerSettings
from services.worker.workdirs import SpareLogs, Workdirs

log = logging.getLogger("cairn.worker")

#: ready folder sets made as the agent starts (more as attempts need them, up to its slots)
AHEAD = 64
#: how long after its spawn helper's check of a ``file://`` source did not answer every
#: start of that source fails at once, no helper asked (each ask may leave one more
#: checker waiting in the kernel); at most this many sources are held so
HUNG_SOURCE_HOLD_S = 60.0
HUNG_SOURCES_MAX = 1024
GIVES_UP = (
    "attempts run as the agent's own user: they can read its token and environment, "
    "signal it, read other attempts' folders and logs, and change the artifact cache"
)


class HostError(Exception):
    """The agent cannot start with these settings; the message says why and what to do."""


@dataclass
class Prepared:
    """One attempt made ready to start, and what to undo when it ends."""

    spec: AttemptSpec
    folders: Folders
    identity: Identity | None
    cgroup: AttemptCgroup | None
    slot: Slot | None = None
    #: the ``file://`` artifact (uri, sha256) whose source its spawn helper checks
    #: (``Folders.source_check``): sealed again if that check fails (``Host.launch``)
    local: tuple[str, str] | None = None
    #: the end of a start its spawn helper was sent when ``launch`` was cancelled: what
    #: it started killed, settled by its exit record (or the helper's end); ``release``
    #: hands nothing back before
    unsettled: asyncio.Future[None] | None = None

    def abandoned(self, ended: asyncio.Future[None]) -> None:
        self.unsettled = ended


class Host:
    """``fast`` (the default): attempts are started by resident spawn helpers, in pooled
    cgroups on v1 (``spawner``, ``cgpool``); False, or without a C compiler: forked from
    the agent with ``preexec_fn``, in a fresh cgroup each."""

    def __init__(self, settings: WorkerSettings, logs_dir: Path, fast: bool = True) -> None:
        self.fast = fast
        self.binary: Path | None = None
        self.helper: spawner.Helper | None = None
        self.slots: CgroupPool | None = None
        self.settings = settings
        self.logs_dir = logs_dir
        self._last_log: tuple[int, Path] = (0, logs_dir)
        self.isolated = settings.worker_isolation == "user" and os.geteuid() == 0
        self.pool: UidPool | None = None
        self.private_tmp = False
        #: attempts' homes and tmp on a tmpfs of their own, sized by their disk quota
        self.tmpfs = False
        self.fresh_shm = False  # a private /dev/shm (not where the run folder lies)
        self.own_ipc = False  # an IPC namespace per attempt (``Sandbox.ipc``)
        self.tmp_targets: tuple[str, ...] = ()
        self.cgroups: Cgroups | None = None
        self.run_dir = settings.worker_run_dir or settings.home / "attempts"
        self._leftover: list[AttemptCgroup] = []
        self._keeping: set[asyncio.Task[None]] = set()
        self.workdirs = Workdirs(self.run_dir, self.isolated, settings.worker_slots)
        self.spare_logs = SpareLogs(logs_dir, settings.worker_slots)
        self.sealed: Sealed | None = None
        #: ``file://`` sources whose check did not answer: until when each fails at once
        self._hung: dict[str, float] = {}
        #: the agent's egress table (``firewall``); None: not isolated, or no nftables
        self.firewall: firewall.Firewall | None = None
        self._allowing: set[int] = set()  # uids with an ``allow`` chain
        #: each device index's node (``CAIRN_WORKER_DEVICE_NODES``), for the device cgroup
        self.device_nodes = settings.device_nodes

    def start(self) -> list[str]:
        """Check and set up; returns what the agent tells at start-up. Raises HostError."""
        notes = self._who()
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o711 if self.isolated else 0o700)
        self.run_dir.chmod(0o711 if self.isolated else 0o700)
        self.logs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.workdirs.start(ahead=min(AHEAD, self.settings.worker_slots))
        self.spare_logs.start()
        if self.isolated:
            sealed = self.workdirs.pool / "sealed"
            sealed.mkdir(mode=0o700)
            self.sealed = Sealed(sealed, self.settings.worker_cache_mb * 2**20)
            blocked = searchable_by_others(self.run_dir)
            if blocked is not None:
                raise HostError(
                    f"attempts' uids cannot reach {self.run_dir}: {blocked} is not searchable "
                    "by others; set CAIRN_WORKER_RUN_DIR to a folder whose every parent is "
                    "(such as /var/lib/cairn/attempts)"
                )
            self.pool = UidPool(self.settings.uids, self.settings.worker_uid_locks)
            notes.append(self._tmp_note())
            notes.append(self._disk_note())
            notes.append(self._ipc_note())
        notes.append(self._egress_note())
        self.cgroups, note = Cgroups.detect(devices=bool(self.device_nodes))
        notes.append(note)
        if self.device_nodes:
            notes.append(self._devices_note())
        if self.cgroups is not None:
            self.cgroups.sweep()
        notes.append(self._starter())
        return notes

    def _starter(self) -> str:
        binary = spawner.build(spawner.default_folders(self.settings.home)) if self.fast else None
        if binary is None:
            why = "no C compiler for the spawn helper" if self.fast else "fast start disabled"
            return f"{why}: attempts are forked from the agent (preexec_fn)"
        self.binary = binary
        self.helper = spawner.Helper(binary)
        if self.cgroups is not None and self.cgroups.version == "v1":
            self.slots = CgroupPool(self.cgroups, binary, self.settings.worker_slots)
            return "attempts are started by spawn helpers resident in pooled cgroups (v1)"
        return "attempts are started by a resident spawn helper (cgroup v2: CLONE_INTO_CGROUP)"

    def _who(self) -> list[str]:
        if self.isolated:
            uids = self.settings.uids
            return [f"attempts run as uids {uids.start}-{uids.stop - 1}, one each, unprivileged"]
        if self.settings.worker_isolation == "user":
            if self.settings.env == "production":
                raise HostError(
                    "the agent is not root, so it cannot run attempts as users of their own; "
                    f"run it as root, or set CAIRN_WORKER_ISOLATION=none to accept that {GIVES_UP}"
                )
            return [f"not root, so no isolation (development): {GIVES_UP}"]
        return [f"CAIRN_WORKER_ISOLATION=none: {GIVES_UP}"]

    def _egress_note(self) -> str:
        if not self.isolated:
            return (
                "egress is not enforced (attempts run as the agent's user): attempts of "
                "queues with egress none or allow fail here"
            )
        extra = firewall.parse_blocked(self.settings.worker_egress_block)
        wall = firewall.Firewall(
            self.settings.home, os.getpid(), self.settings.uids, firewall.blocked(extra)
        )
        try:
            wall.start()
        except firewall.FirewallError as exc:
            log.warning("no egress table (%s): link-local and the database stay reachable", exc)
            return (
                f"egress: nftables unavailable ({exc}): the blocklist is not enforced and "
                "attempts of queues with egress allow fail here; egress none still works"
            )
        self.firewall = wall
        shown = ", ".join(str(n) + (f" port {p}" if p else "") for n, p in wall.refused)
        return f"egress: attempts never reach {shown} (nftables table {wall.table})"

    def _devices_note(self) -> str:
        if self.cgroups is not None and "devices" in self.cgroups.bases:
            return "device nodes: an attempt opens only those of the devices it holds (cgroup v1)"
        return (
            "device nodes are not confined here (no cgroup v1 devices controller): an "
            "attempt is told its devices but could open the others'"
        )

    def _tmp_note(self) -> str:
        if not mount_namespaces_work():
            return "no mount namespaces here: each attempt's TMPDIR is its own, /tmp is shared"
        self.private_tmp = True
        shared = [t for t in OWN_TMP if _under(self.run_dir, t)]
        found, cut = host_writable_folders(self.settings.worker_uid_locks)
        elsewhere = [t for t in found if not _under(self.run_dir, t)]
        self.tmp_targets = (*(t for t in ("/tmp", "/var/tmp") if t not in shared), *elsewhere)
        self.fresh_shm = "/dev/shm" not in shared
        note = "each attempt has its own /tmp, /var/tmp and /dev/shm (a mount namespace)"
        if elsewhere:
            note += f"; its /tmp is bound on {', '.join(elsewhere)} too (world-writable here)"
        if shared:
            note += f"; {', '.join(shared)} stay shared: the run folder lies under them"
        if cut is not None:
            note += (
                f"; the look for world-writable folders {cut}: any others stay shared"
                " between attempts"
            )
        return note

    def _ipc_note(self) -> str:
        if not ipc_namespaces_work():
            return (
                "no IPC namespaces here: System V shared memory and message queues an "
                "attempt leaves outlive it, and the next attempt given its uid may use them"
            )
        self.own_ipc = True
        return "each attempt has its own System V IPC (an IPC namespace), gone with it"

    def _disk_note(self) -> str:
        if not self.private_tmp or not tmpfs.works():
            return "no private tmpfs here: attempts' folders are on disk, with no disk quota"
        if self.settings.worker_keep_attempts_s > 0:
            return (
                "attempts' folders are kept on disk (CAIRN_WORKER_KEEP_ATTEMPTS_S): no disk quota"
            )
        self.tmpfs = True
        return (
            "each attempt's home and /tmp are a tmpfs of its own, its disk quota in size "
            f"(default {self.settings.worker_disk_mb} MB), charged to its memory"
        )

    @property
    def _bound(self) -> bool:
        """Whether an attempt's sealed executable is bound on a placeholder by its spawn
        helper (``workdirs.Workdirs.placeholder``) rather than linked into a folder of its
        own: where a helper starts attempts (its home then a tmpfs, in a mount namespace)."""
        return self.binary is not None

    def _link(self, folders: Folders, sealed: Path) -> None:
        """``folders.link_executable``; a copy bound on a placeholder is named by its path
        alone until its start binds it: held from the cache's eviction (``Sealed.hold``)
        until the folders are given back."""
        folders.link_executable(sealed)
        if folders.placeholder and self.sealed is not None:
            folders.unbind = self.sealed.hold(sealed)

    def _quota_mb(self, assignment: Assignment) -> int | None:
        """The size of the attempt's tmpfs; None: its folders are on disk."""
        if not (self.tmpfs and self.private_tmp):
            return None
        return assignment.resources.disk_mb or self.settings.worker_disk_mb

    async def prepare(
        self,
        assignment: Assignment,
        cache: ArtifactCache,
        devices: Mapping[str, list[int]] | None = None,
    ) -> Prepared:
        """Folders, the verified executable and the cgroup of one attempt (which may open
        only the device nodes of ``devices``, the indexes it holds, where nodes are
        configured). Raises ``ArtifactError``, ``IsolationError`` or ``OSError`` (after
        undoing its part)."""
        identity = self.pool.take() if self.pool is not None else None
        folders: Folders | None = None
        group: AttemptCgroup | None = None
        slot: Slot | None = None
        try:
            await self._egress(assignment.egress, identity)
            # Folder work blocks on the file system's journal: off the event loop; for a
            # file:// artifact, the folders, the verified copy and its seal in one hand-off,
            # to the thread that opens its source as the attempt (``in_open_thread``),
            # unless nothing of it blocks long (``_local_files_here``).
            if assignment.artifact.uri.startswith("file:"):
                folders = self._local_files_here(assignment, identity, cache)
                if folders is None:
                    folders = await in_open_thread(
                        functools.partial(self._local_files, assignment, identity, cache)
                    )
            else:
                folders = await self._fetched_files(assignment, identity, cache)
            resources = assignment.resources
            pids_max = self.settings.worker_pids_max
            if self.slots is not None:
                slot = await self.slots.take(resources.memory_mb, resources.cpu, pids_max)
                group = slot.group
            elif self.cgroups is not None:
                # v2: the helper starts the attempt into it, and writes its quota then
                group = self.cgroups.create(
                    assignment.attempt_id,
                    resources.memory_mb,
                    resources.cpu,
                    pids_max,
                    defer_cpu=self.helper is not None,
                )
            if self.device_nodes and group is not None:
                group.confine_devices(denied(self.device_nodes, devices or {}))
            spec = self._spec(assignment, folders, identity, group, slot)
            if assignment.checkpoint is not None:
                data = b64decode(assignment.checkpoint)
                await asyncio.to_thread(progress.place_checkpoint, folders.view, data, identity)
        except BaseException:
            log_path = self._log_path(assignment)
            await self._undo(folders, identity, group, slot, log_path, never_ran=True)
            raise
        local = None
        if folders.source_check is not None:
            local = (assignment.artifact.uri, assignment.artifact.sha256)
        return Prepared(spec, folders, identity, group, slot, local)

    async def launch(
        self, prepared: Prepared, cache: ArtifactCache, spec: AttemptSpec | None = None
    ) -> RunningAttempt:
        """Start the prepared attempt (``spec``: its spec as the caller changed it). If its
        spawn helper finds its ``file://`` source no longer the file of the stamp it was
        prepared with (``Folders.source_check``: changed, replaced, unreadable), nothing
        of it ran: the source is sealed again as the attempt (hashed unless unchanged,
        in the thread that opens files as attempts, as when no stamp is known) and the
        attempt started once more. Raises ``SpawnError``, or ``ArtifactError`` (the source
        is unreadable now, or its bytes are not the digest's)."""
        spec = spec or prepared.spec
        check = spec.sandbox.source_check if spec.sandbox else None
        if check is not None and self._hung and self._hung.get(check[0], 0.0) > time.monotonic():
            raise unanswered(spec, f"another start within {HUNG_SOURCE_HOLD_S:g} s")
        try:
            return await start_attempt(spec, prepared.abandoned)
        except SourceUnanswered:
            if check is not None:
                self._held_hung(check[0])
            raise
        except SourceChanged:
            if prepared.local is None or self.sealed is None or prepared.identity is None:
                raise
        uri, sha256 = prepared.local
        cache.forget_local(uri)
        sealed = await in_open_thread(
            functools.partial(cache.seal_local, uri, sha256, prepared.identity, self.sealed)
        )
        folders = prepared.folders
        unbind, folders.unbind = folders.unbind, None
        if unbind is not None:
            unbind()
        self._link(folders, sealed)
        folders.source_check, prepared.local = None, None
        assert spec.sandbox is not None  # a checked source is a sandboxed attempt's
        sandbox = dataclasses.replace(
            spec.sandbox, bind=(str(sealed), str(folders.executable)), source_check=None
        )
        spec = dataclasses.replace(spec, sandbox=sandbox)
        prepared.spec = dataclasses.replace(prepared.spec, sandbox=sandbox)
        return await start_attempt(spec, prepared.abandoned)

    def _held_hung(self, source: str) -> None:
        now = time.monotonic()
        for path in [path for path, until in self._hung.items() if until <= now]:
            del self._hung[path]
        if len(self._hung) >= HUNG_SOURCES_MAX:
            del self._hung[next(iter(self._hung))]
        self._hung[source] = now + HUNG_SOURCE_HOLD_S

    async def _egress(self, policy: Egress | None, identity: Identity | None) -> None:
        """Refuse a policy this agent cannot apply; open an ``allow`` attempt's chain
        (before its process starts; closed by ``_undo``)."""
        if policy is None or policy.mode == "host":
            return
        if identity is None:
            raise firewall.Unenforceable(
                f"this worker cannot apply egress {policy.mode}: its attempts run as the "
                "agent's own user (it is not root, or CAIRN_WORKER_ISOLATION=none)"
            )
        if policy.mode == "allow":
            if self.firewall is None:
                raise firewall.Unenforceable(
                    "this worker cannot apply egress allow: nftables is unavailable here"
                )
            self._allowing.add(identity.uid)
            try:
                await asyncio.to_thread(self.firewall.open, identity.uid, policy)
            except firewall.FirewallError as exc:
                raise firewall.Unenforceable(f"egress allow not applied: {exc}") from None

    def _local_files(
        self, assignment: Assignment, identity: Identity | None, cache: ArtifactCache
    ) -> Folders:
        artifact = assignment.artifact
        bound = self._bound and self.sealed is not None and identity is not None
        folders = self.workdirs.make(
            assignment.attempt_id,
            _name_of(artifact.uri),
            identity,
            self._quota_mb(assignment),
            bound,
        )
        self.spare_logs.take(self._log_path(assignment))
        try:
            if self.sealed is not None and identity is not None:
                sealed = cache.seal_local(artifact.uri, artifact.sha256, identity, self.sealed)
                self._link(folders, sealed)
            else:
                written = cache.copy_local(
                    artifact.uri, artifact.sha256, folders.executable.parent, identity
                )
                folders.seal_executable(written)
        except BaseException:
            self.workdirs.give_back(folders, reusable=True)
            raise
        return folders

    def _local_files_here(
        self, assignment: Assignment, identity: Identity | None, cache: ArtifactCache
    ) -> Folders | None:
        """``_local_files`` on the event loop, with no thread's round trip (0.1-0.15 ms of
        the agent's CPU an attempt), where none of it blocks for long: the home a tmpfs
        (nothing made or walked on disk: a rename, a chown and a link, as ``_undo``'s
        give back), its sealed copy known and its local source unchanged
        (``sealed_known``: one open as the attempt, on this thread, nothing read; where a
        spawn helper starts it, that open is the helper's checker's, before anything else
        and bounded in time: ``sealed_stamp``, ``Folders.source_check``, and ``launch`` if
        it fails); None otherwise, having done nothing."""
        quota_mb = self._quota_mb(assignment)
        if self.sealed is None or identity is None or quota_mb is None:
            return None
        artifact = assignment.artifact
        check: tuple[Path, Stamp] | None = None
        if self._bound:
            stamped = cache.sealed_stamp(artifact.uri, artifact.sha256, self.sealed)
            if stamped is None:
                return None
            sealed, source, stamp = stamped
            check = (source, stamp)
        else:
            open_as_here()
            known = cache.sealed_known(artifact.uri, artifact.sha256, identity, self.sealed)
            if known is None:
                return None
            sealed = known
        folders = self.workdirs.make(
            assignment.attempt_id, _name_of(artifact.uri), identity, quota_mb, self._bound
        )
        self.spare_logs.take(self._log_path(assignment))
        try:
            self._link(folders, sealed)
        except FileNotFoundError:  # its copy evicted since it was found: sealed again
            self.workdirs.give_back(folders, reusable=True)
            return None
        except BaseException:
            self.workdirs.give_back(folders, reusable=True)
            raise
        folders.source_check = check
        return folders

    async def _fetched_files(
        self, assignment: Assignment, identity: Identity | None, cache: ArtifactCache
    ) -> Folders:
        artifact = assignment.artifact
        folders = await asyncio.to_thread(self._made, assignment, identity)
        try:
            if self.sealed is not None and identity is not None:
                sealed = await cache.seal(
                    artifact.uri, artifact.sha256, self.sealed, assignment.artifact_credentials
                )
                await asyncio.to_thread(self._link, folders, sealed)
            else:
                written = await cache.materialize(
                    artifact.uri,
                    artifact.sha256,
                    folders.executable.parent,
                    identity,
                    assignment.artifact_credentials,
                )
                await asyncio.to_thread(folders.seal_executable, written)
        except BaseException:
            await asyncio.to_thread(self.workdirs.give_back, folders, True)
            raise
        return folders

    def _made(self, assignment: Assignment, identity: Identity | None) -> Folders:
        name = _name_of(assignment.artifact.uri)
        bound = self._bound and self.sealed is not None and identity is not None
        folders = self.workdirs.make(
            assignment.attempt_id, name, identity, self._quota_mb(assignment), bound
        )
        self.spare_logs.take(self._log_path(assignment))
        return folders

    def _log_path(self, assignment: Assignment) -> Path:
        # Asked twice an attempt (its spare log, its spec): one path made, not two.
        attempt, path = self._last_log
        if attempt != assignment.attempt_id:
            path = self.logs_dir / f"{assignment.attempt_id}.log"
            self._last_log = (assignment.attempt_id, path)
        return path

    def _spec(
        self,
        assignment: Assignment,
        folders: Folders,
        identity: Identity | None,
        group: AttemptCgroup | None,
        slot: Slot | None = None,
    ) -> AttemptSpec:
        helper = slot.helper if slot is not None else self._plain_helper()
        if group is not None and group.version == "v1" and slot is None:
            helper = None  # a fresh v1 cgroup is joined from preexec_fn
        enforced = self.cgroups.enforced if self.cgroups else frozenset()
        limits: list[tuple[int, int]] = [(resource.RLIMIT_CORE, 0)]
        if "memory" not in enforced:
            limits.append((resource.RLIMIT_DATA, assignment.resources.memory_mb * 2**20))
        if "pids" not in enforced and identity is not None:
            limits.append((resource.RLIMIT_NPROC, self.settings.worker_pids_max))
        sandbox = Sandbox(
            identity=identity,
            cgroup_procs=tuple(group.procs_files) if group and helper is None else (),
            private_tmp=folders.tmp if self.private_tmp else None,
            tmp_targets=self.tmp_targets,
            shm=self.fresh_shm,
            rlimits=tuple(limits),
            netns=assignment.egress is not None and assignment.egress.mode == "none",
            ipc=self.own_ipc,
            mount=folders.mount,
            home=str(folders.home) if folders.mount is not None else None,
            bind=(str(folders.bound), str(folders.executable)) if folders.bound else None,
            source_check=_source_check(folders.source_check),
            source_timeout_s=self.settings.worker_source_timeout_s,
        )
        tmpdir = "/tmp" if self.private_tmp and "/tmp" in self.tmp_targets else str(folders.tmp)
        return AttemptSpec(
            executable=folders.executable,
            workdir=folders.home,
            log_path=self._log_path(assignment),
            task_id=assignment.task_id,
            attempt_id=assignment.attempt_id,
            attempt_number=assignment.attempt_number,
            args=assignment.args,
            env=progress.with_paths(
                outputs.with_path(_traced(assignment), folders.home),
                folders.home,
                assignment,
                self.settings.url,
            ),
            input_path=assignment.input_path,
            output_path=assignment.output_path,
            timeout_s=assignment.timeout_s,
            progress_timeout_s=assignment.progress_timeout_s,
            memory_mb=assignment.resources.memory_mb,
            cpu=assignment.resources.cpu,
            sandbox=sandbox,
            cgroup=group,
            tmpdir=tmpdir,
            helper=helper,
            log_max_bytes=self.settings.log_max_bytes,
            disk_mb=folders.quota_mb,
        )

    async def stop_leftovers(self, prepared: Prepared) -> None:
        """Kill whatever of the attempt still runs (its cgroup, or its uid)."""
        if prepared.cgroup is not None:
            prepared.cgroup.kill_all()
        elif prepared.identity is not None:
            await self._kill_uid(prepared.identity)

    def _plain_helper(self) -> spawner.Helper | None:
        """The helper outside any pooled cgroup, started again if it died."""
        if self.helper is not None and not self.helper.alive() and self.binary is not None:
            log.warning("the spawn helper (pid %s) is gone; starting another", self.helper.pid)
            self.helper.close()
            self.helper = spawner.Helper(self.binary)
        return self.helper

    async def _kill_uid(self, identity: Identity) -> None:
        """Every process of the uid: by the resident helper (no shell spawned), else by
        ``kill -9 -1`` from a shell run as that uid."""
        helper = self._plain_helper()
        if helper is not None:
            try:
                await helper.kill_uid(identity.uid)
                return
            except spawner.HelperGone:
                log.warning("the spawn helper is gone; killing uid %s by shell", identity.uid)
        await asyncio.to_thread(kill_every_process_of, identity)

    async def release(self, prepared: Prepared) -> None:
        """After the log is uploaded: remove the folders (now, or after the keep time),
        then hand the uid back (never while a folder of that uid remains). An attempt
        whose ``launch`` was cancelled after its spawn helper was asked first waits for
        the end of what that start ran (``Prepared.unsettled``: killed at once): until
        then its process may still be born, in its slot, as its uid."""
        if prepared.unsettled is not None:
            await prepared.unsettled
        keep = self.settings.worker_keep_attempts_s
        log_path = prepared.spec.log_path
        if keep <= 0:
            await self._undo(
                prepared.folders, prepared.identity, prepared.cgroup, prepared.slot, log_path
            )
            return
        settled = await self._release_cgroup(prepared.cgroup, prepared.slot)

        async def later() -> None:
            await asyncio.sleep(keep)
            await self._undo(prepared.folders, prepared.identity, None, None, log_path, settled)

        task = asyncio.create_task(later())
        self._keeping.add(task)
        task.add_done_callback(self._keeping.discard)

    async def _release_cgroup(self, group: AttemptCgroup | None, slot: Slot | None) -> bool:
        """Empty the attempt's cgroup (a pooled slot goes back to its pool); whether it
        was seen empty, so that no process of the attempt can write any more."""
        if slot is not None and self.slots is not None:
            return await self.slots.give_back(slot)  # emptied, checked, then reused
        if group is not None:
            if group.remove():
                return True
            self._leftover.append(group)
        return False

    async def _undo(
        self,
        folders: Folders | None,
        identity: Identity | None,
        group: AttemptCgroup | None,
        slot: Slot | None = None,
        log_path: Path | None = None,
        never_ran: bool = False,
    ) -> None:
        """Hand back what the attempt held; its folders are reused only if nothing of it
        can still be running (it never ran, or its cgroup was seen empty)."""
        if folders is not None:
            await _unmount(folders)  # its tmpfs's pages uncharged before its cgroup is reused
        try:
            settled = await self._release_cgroup(group, slot)
            if group is None and slot is None and identity is not None and not never_ran:
                await self._kill_uid(identity)  # no cgroup: nothing proves it empty
            reusable = settled or never_ran
            if folders is None or folders.quota_mb is not None:
                # A tmpfs home (let go above) leaves nothing to walk: the executable
                # folder's one link and two renames, cheaper here than a thread's round
                # trip (0.1 ms of the agent's CPU an attempt).
                self._give_back(folders, log_path, reusable)
            else:
                await asyncio.to_thread(self._give_back, folders, log_path, reusable)
        finally:
            if identity is not None and self.pool is not None:
                await self._close_egress(identity)
                self.pool.give_back(identity)

    async def _close_egress(self, identity: Identity) -> None:
        """Remove the uid's ``allow`` chain before the uid is handed back."""
        if identity.uid in self._allowing and self.firewall is not None:
            self._allowing.discard(identity.uid)
            await asyncio.to_thread(self.firewall.close, identity.uid)

    def _give_back(self, folders: Folders | None, log_path: Path | None, reusable: bool) -> None:
        if folders is not None:
            self.workdirs.give_back(folders, reusable)
        if log_path is not None:
            self.spare_logs.give_back(log_path)

    def tidy(self) -> None:
        """Retry removing cgroups whose last processes were still exiting."""
        self._leftover = [group for group in self._leftover if not group.remove()]
        self.workdirs.tidy()
        if self.slots is not None:
            self.slots.tidy()

    async def close(self) -> None:
        for task in list(self._keeping):
            task.cancel()
        self.tidy()
        if self.slots is not None:
            self.slots.close()
        if self.helper is not None:
            self.helper.close()
        if self.cgroups is not None:
            self.cgroups.close()
        if self.firewall is not None:
            await asyncio.to_thread(self.firewall.stop)
        await asyncio.to_thread(self._give_up_spares)

    def _give_up_spares(self) -> None:
        self.workdirs.close()
        self.spare_logs.close()


async def _unmount(folders: Folders) -> None:
    """Let the attempt's tmpfs go: at once when it holds little, else in a thread (the
    closing thread frees its pages, a millisecond for every few MB)."""
    if folders.mount is not None and tmpfs.used_mb(folders.mount) > tmpfs.FREE_INLINE_MB:
        await asyncio.to_thread(folders.unmount)
    folders.unmount()


def _source_check(check: tuple[Path, Stamp] | None) -> tuple[str, Stamp] | None:
    return (str(check[0]), check[1]) if check is not None else None


def _under(path: Path, top: str) -> bool:
    return path == Path(top) or Path(top) in path.parents


def _name_of(uri: str) -> str:
    """The executable's file name, from the URI's last segment (``run`` if it has none)."""
    last = uri.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    clean = "".join(c for c in last if c.isalnum() or c in "._-")[:100].lstrip(".")
    return clean or "run"


def _traced(assignment: Assignment) -> dict[str, str]:
    """The task's environment with the W3C trace context of its run (docs/observability.md):
    its own ``TRACEPARENT``, if it sets one, is kept."""
    context = tracing.task_environment(assignment.traceparent)
    return {**context, **assignment.env} if context else assignment.env
