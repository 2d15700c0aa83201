"""Container Device Interface: spec files parsed, devices resolved by their fully-qualified
name (`vendor.com/class=name`), and their container edits applied to an OCI spec.

A request names devices in `ContainerConfig.CDI_devices` or, as kubelet's device plugins
still do, in `cdi.k8s.io/<key>` annotations whose values are comma-separated names.

Spec files are found in the configured directories; a later directory overrides an earlier
one for the same device, and two files of one directory defining the same device are an
error naming both. The directories are scanned again at every resolve (a stat per file) and
a file is parsed again only when its (inode, mtime, ctime, size) changed: a spec file edited
just before a CreateContainer is always seen, which an inotify watcher, whose events arrive
later than the write, could not promise.

Spec files are written by device plugins and operators, not by us: whatever one holds, it
can only break its own devices, and only costs what a file of its size should. A file is
read only if it is a regular file inside its directory (a symlink out of it is refused),
of at most `MAX_SPEC_BYTES`; once decoded it may hold at most `MAX_SPEC_VALUES` (a YAML
alias repeats what it names: 27 KB of aliases once made 46 MB of hook arguments) nested at
most `MAX_SPEC_DEPTH` deep. Files are parsed outside the registry's lock, in the creation's
worker thread. A broken file is named in the errors of the devices of its kind, and of
devices that no file defines.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.host.files import read_small_file
from cri_shim.runtime.cdi_request import requested_devices

# The versions of the spec that current device plugins write; 0.1 and 0.2 had another schema.
SUPPORTED_VERSIONS = frozenset({"0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0"})
SPEC_SUFFIXES = (".json", ".yaml")
HOOK_NAMES = (
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
)
_VENDOR = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
_CLASS = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_-]*[A-Za-z0-9])?$")
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
# intelRdt's keys and the kind of value each takes.
_INTEL_RDT_KEYS: tuple[tuple[str, type, str], ...] = (
    ("closID", str, "a string"),
    ("l3CacheSchema", str, "a string"),
    ("memBwSchema", str, "a string"),
    ("enableCMT", bool, "true or false"),
    ("enableMBM", bool, "true or false"),
)
# Real spec files are tens of KiB (every GPU of a node with its driver's libraries).
MAX_SPEC_BYTES = 1 << 20
# The decoded content's size: a value counts one and a string its length too. Without
# aliases a file decodes to less than its own size; with them to any size.
MAX_SPEC_VALUES = 2 * MAX_SPEC_BYTES
# A spec's own nesting is six deep (devices[].containerEdits.deviceNodes[].path).
MAX_SPEC_DEPTH = 32


@dataclass(frozen=True)
class DeviceNode:
    path: str
    host_path: str
    type: str = ""  # "c", "b", "p"; "" is taken from the host node
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = None
    permissions: str = "rwm"
    uid: int | None = None
    gid: int | None = None


@dataclass(frozen=True)
class Mount:
    host_path: str
    container_path: str
    type: str = ""
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class Hook:
    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None


@dataclass(frozen=True)
class ContainerEdits:
    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()
    additional_gids: tuple[int, ...] = ()
    intel_rdt: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class SpecFile:
    path: Path
    version: str
    kind: str  # "vendor/class"
    edits: ContainerEdits  # applied once when any of its devices is asked for
    devices: Mapping[str, ContainerEdits] = field(default_factory=dict)


@dataclass(frozen=True)
class ResolvedDevice:
    name: str  # fully qualified
    spec: SpecFile
    edits: ContainerEdits


def parse_qualified_name(name: str) -> tuple[str, str, str]:
    """(vendor, class, device) of `vendor.com/class=device`; InvalidArgument otherwise."""
    kind, eq, device = name.partition("=")
    vendor, slash, cls = kind.partition("/")
    if not (eq and slash and _VENDOR.match(vendor) and _CLASS.match(cls) and _NAME.match(device)):
        raise InvalidArgument(
            f"CDI device {name!r}: not a fully-qualified name (vendor.com/class=name)"
        )
    return vendor, cls, device


# ---- parsing ---------------------------------------------------------------------------


class _Fields:
    """Typed reads of one JSON object, each failure naming the file and the field."""

    def __init__(self, path: Path, where: str, obj: object) -> None:
        if not isinstance(obj, dict):
            raise _bad(path, where or "the file", "expected an object")
        self.path, self.where, self.obj = path, where, obj

    def _at(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(
        self, key: str, kind: type | tuple[type, ...], what: str, *, required: bool = False
    ) -> Any:
        if key not in self.obj or self.obj[key] is None:
            if required:
                raise _bad(self.path, self._at(key), "is required")
            return None
        value = self.obj[key]
        # bool is an int in Python, never in a spec file.
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise _bad(self.path, self._at(key), f"expected {what}")
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        values = self.get(key, list, "a list of strings") or []
        if not all(isinstance(v, str) for v in values):
            raise _bad(self.path, self._at(key), "expected a list of strings")
        return tuple(values)

    def objects(self, key: str) -> list[_Fields]:
        values = self.get(key, list, "a list of objects") or []
        return [_Fields(self.path, f"{self._at(key)}[{i}]", v) for i, v in enumerate(values)]

    def nested(self, key: str) -> _Fields | None:
        value = self.get(key, dict, "an object")
        return None if value is None else _Fields(self.path, self._at(key), value)


def _bad(path: Path, where: str, problem: str) -> InvalidArgument:
    return InvalidArgument(f"CDI spec file {path}: {where}: {problem}")


def _unusable(path: Path, problem: str) -> InvalidArgument:
    return InvalidArgument(f"CDI spec file {path}: {problem}")


def read_spec_file(path: Path, directory: Path | None = None) -> bytes:
    """A spec file's bytes: a regular file of at most MAX_SPEC_BYTES, which a symlink may
    name only from inside `directory` (where it was found)."""
    real = Path(os.path.realpath(path))
    if directory is not None and not real.is_relative_to(os.path.realpath(directory)):
        raise _unusable(path, f"a symlink to {real}, outside {directory}; not read")
    try:
        return read_small_file(real, MAX_SPEC_BYTES, follow_symlink=False)
    except OSError as exc:
        raise _unusable(path, f"cannot be read: {exc.strerror}") from None
    except ValueError as exc:
        raise _unusable(path, f"cannot be read: {exc}") from None


def decode_spec_file(path: Path, directory: Path | None = None) -> object:
    """One spec file's content, decoded and of a sane size, but not checked."""
    text = read_spec_file(path, directory)
    try:
        if path.suffix == ".yaml":
            data = _decode_yaml(path, text)
        else:
            try:
                data = json.loads(text)
            except ValueError as exc:
                raise _unusable(path, f"not valid JSON: {exc}") from None
    except RecursionError:
        raise _unusable(path, "nested too deep to decode") from None
    _check_decoded_size(path, data)
    return data


def _decode_yaml(path: Path, text: bytes) -> object:
    import yaml  # only where a YAML spec exists: it costs the idle daemon memory

    # libyaml's loader where it is installed: ten times faster, and bounded in nesting.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        return yaml.load(text, Loader=loader)
    except yaml.YAMLError as exc:
        raise _unusable(path, f"not valid YAML: {exc}") from None


def _check_decoded_size(path: Path, data: object) -> None:
    """Refuse content past MAX_SPEC_VALUES or MAX_SPEC_DEPTH, counting each use of a
    YAML alias as what it names (as everything downstream sees it); walked without
    recursion, and stopped at the first value past a limit."""
    size = 0
    pending: list[tuple[object, int]] = [(data, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > MAX_SPEC_DEPTH:
            raise _unusable(path, f"nested more than {MAX_SPEC_DEPTH} deep")
        size += 1
        if isinstance(value, str):
            size += len(value)
        elif isinstance(value, dict):
            size += sum(len(k) for k in value if isinstance(k, str))
            pending.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            pending.extend((v, depth + 1) for v in value)
        if size > MAX_SPEC_VALUES:
            raise _unusable(
                path,
                f"decodes to more than {MAX_SPEC_VALUES} values and characters (YAML "
                "aliases repeat what they name); refused",
            )


def parse_spec(path: Path, data: object) -> SpecFile:
    """A spec file's decoded content, checked; InvalidArgument naming the file and field."""
    top = _Fields(path, "", data)
    version = top.get("cdiVersion", str, "a string", required=True)
    if version not in SUPPORTED_VERSIONS:
        raise _bad(
            path,
            "cdiVersion",
            f"version {version!r} is not supported (supported: "
            f"{', '.join(sorted(SUPPORTED_VERSIONS))})",
        )
    kind = top.get("kind", str, "a string", required=True)
    vendor, slash, cls = kind.partition("/")
    if not (slash and _VENDOR.match(vendor) and _CLASS.match(cls)):
        raise _bad(path, "kind", f"{kind!r} is not vendor.com/class")
    devices: dict[str, ContainerEdits] = {}
    entries = top.objects("devices")
    if not entries:
        raise _bad(path, "devices", "at least one device is required")
    for entry in entries:
        name = entry.get("name", str, "a string", required=True)
        if not _NAME.match(name):
            raise _bad(path, f"{entry.where}.name", f"{name!r} is not a valid device name")
        if name in devices:
            raise _bad(path, f"{entry.where}.name", f"device {name!r} is defined twice")
        edits = _edits(entry.nested("containerEdits"))
        if edits == ContainerEdits():
            raise _bad(path, f"{entry.where}.containerEdits", "a device needs at least one edit")
        devices[name] = edits
    return SpecFile(path, version, kind, _edits(top.nested("containerEdits")), devices)


def _edits(fields: _Fields | None) -> ContainerEdits:
    if fields is None:
        return ContainerEdits()
    env = fields.strings("env")
    for index, item in enumerate(env):
        if "=" not in item or item.startswith("="):
            raise _bad(fields.path, f"{fields.where}.env[{index}]", f"{item!r} is not KEY=value")
    nodes = tuple(_device_node(f) for f in fields.objects("deviceNodes"))
    mounts = tuple(_mount(f) for f in fields.objects("mounts"))
    hooks = tuple(_hook(f) for f in fields.objects("hooks"))
    gids = fields.get("additionalGids", list, "a list of group ids") or []
    if not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gids):
        raise _bad(fields.path, f"{fields.where}.additionalGids", "expected a list of group ids")
    rdt = fields.nested("intelRdt")
    intel_rdt = None
    if rdt is not None:
        # Checked, as the values go into the OCI spec as they are.
        intel_rdt = {
            key: value
            for key, kind, what in _INTEL_RDT_KEYS
            if (value := rdt.get(key, kind, what)) is not None
        }
    return ContainerEdits(env, nodes, mounts, hooks, tuple(gids), intel_rdt)


def _absolute(fields: _Fields, key: str, *, required: bool) -> str:
    value = fields.get(key, str, "a string", required=required) or ""
    if value and not value.startswith("/"):
        raise _bad(fields.path, f"{fields.where}.{key}", f"{value!r} is not an absolute path")
    return str(value)


def _device_node(fields: _Fields) -> DeviceNode:
    path = _absolute(fields, "path", required=True)
    node_type = fields.get("type", str, "a string") or ""
    if node_type not in ("", "c", "b", "p", "u"):
        raise _bad(fields.path, f"{fields.where}.type", f"{node_type!r} is not b, c, u or p")
    permissions = fields.get("permissions", str, "a string") or "rwm"
    if not set(permissions) <= set("rwm"):
        raise _bad(fields.path, f"{fields.where}.permissions", f"{permissions!r} is not in rwm")
    return DeviceNode(
        path=path,
        host_path=_absolute(fields, "hostPath", required=False) or path,
        type="c" if node_type == "u" else node_type,
        major=fields.get("major", int, "an integer"),
        minor=fields.get("minor", int, "an integer"),
        file_mode=fields.get("fileMode", int, "an integer"),
        permissions=permissions,
        uid=fields.get("uid", int, "an integer"),
        gid=fields.get("gid", int, "an integer"),
    )


def _mount(fields: _Fields) -> Mount:
    return Mount(
        host_path=fields.get("hostPath", str, "a string", required=True),
        container_path=_absolute(fields, "containerPath", required=True),
        type=fields.get("type", str, "a string") or "",
        options=fields.strings("options"),
    )


def _hook(fields: _Fields) -> Hook:
    name = fields.get("hookName", str, "a string", required=True)
    if name not in HOOK_NAMES:
        raise _bad(
            fields.path,
            f"{fields.where}.hookName",
            f"{name!r} is not one of {', '.join(HOOK_NAMES)}",
        )
    timeout = fields.get("timeout", int, "an integer")
    if timeout is not None and timeout <= 0:
        raise _bad(fields.path, f"{fields.where}.timeout", "must be greater than zero")
    return Hook(
        hook_name=name,
        path=_absolute(fields, "path", required=True),
        args=fields.strings("args"),
        env=fields.strings("env"),
        timeout=timeout,
    )


# ---- resolution ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Cached:
    key: tuple[int, int, int, int]
    spec: SpecFile | None
    kind: str = ""  # of a broken file, where it can be read, to blame it for its devices
    error: str = ""


def _load(key: tuple[int, int, int, int], path: Path, directory: Path) -> _Cached:
    try:
        data = decode_spec_file(path, directory)
    except InvalidArgument as exc:
        return _Cached(key, None, error=str(exc))
    kind = data.get("kind") if isinstance(data, dict) else None
    kind = kind if isinstance(kind, str) else ""
    try:
        return _Cached(key, parse_spec(path, data), kind)
    except InvalidArgument as exc:
        return _Cached(key, None, kind, str(exc))


class CdiRegistry:
    """Resolves device names against the spec files of `spec_dirs`, lowest priority first.
    Safe to call from several threads (build_spec runs in one per creation)."""

    def __init__(self, spec_dirs: Sequence[Path]) -> None:
        self.spec_dirs = tuple(dict.fromkeys(spec_dirs))  # a directory listed twice counts once
        self._cache: dict[Path, _Cached] = {}
        self._lock = threading.Lock()

    def _scan(self) -> list[tuple[int, _Cached]]:
        """Every spec file now in the directories with its directory's priority, parsed
        again only if it changed since the last scan. Parsing is done outside the lock:
        one creation reading a large file holds up no other."""
        listed: list[tuple[int, Path, Path, tuple[int, int, int, int]]] = []
        for priority, directory in enumerate(self.spec_dirs):
            try:
                names = sorted(os.listdir(directory))
            except OSError:
                continue  # a directory that does not exist (yet) holds no devices
            for name in names:
                path = directory / name
                if path.suffix not in SPEC_SUFFIXES:
                    continue
                try:
                    st = path.stat()
                except OSError:
                    continue  # removed while scanning
                if not stat.S_ISREG(st.st_mode):
                    continue
                key = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
                listed.append((priority, directory, path, key))
        with self._lock:
            known = {path: self._cache.get(path) for _, _, path, _ in listed}
        loaded = {}
        for _, directory, path, key in listed:
            cached = known[path]
            if cached is None or cached.key != key:
                loaded[path] = _load(key, path, directory)
        with self._lock:
            for gone in self._cache.keys() - known.keys():
                del self._cache[gone]
            self._cache.update(loaded)
        found = []
        for priority, _, path, _ in listed:
            cached = loaded.get(path) or known[path]
            assert cached is not None
            found.append((priority, cached))
        return found

    def resolve(self, names: Iterable[str]) -> list[ResolvedDevice]:
        """The devices of `names`, in order. InvalidArgument naming the device, and the file
        where one is to blame, for a device that is unknown, defined twice in one directory,
        or whose kind has a broken spec file."""
        wanted = list(names)
        if not wanted:
            return []
        parsed = [(n, parse_qualified_name(n)) for n in wanted]
        found = self._scan()
        broken = [(priority, c) for priority, c in found if c.spec is None]
        # Fully-qualified name -> (priority, defining files at that priority, edits).
        table: dict[str, tuple[int, list[SpecFile], ContainerEdits]] = {}
        for priority, cached in found:
            if cached.spec is None:
                continue
            for device, edits in cached.spec.devices.items():
                name = f"{cached.spec.kind}={device}"
                current = table.get(name)
                if current is None or current[0] < priority:
                    table[name] = (priority, [cached.spec], edits)
                elif current[0] == priority:
                    current[1].append(cached.spec)
        resolved: list[ResolvedDevice] = []
        for name, (vendor, cls, _) in parsed:
            entry = table.get(name)
            if entry is None:
                where = ", ".join(str(d) for d in self.spec_dirs)
                errors = "; ".join(c.error for _, c in broken)
                detail = f"; spec files that could not be used: {errors}" if broken else ""
                raise InvalidArgument(
                    f"CDI device {name!r}: unknown, no spec file in {where} defines it{detail}"
                )
            priority, specs, edits = entry
            # A broken file of the device's kind that could override it (same directory or
            # a later one) makes the device's definition uncertain.
            kind_broken = [
                c.error for p, c in broken if c.kind == f"{vendor}/{cls}" and p >= priority
            ]
            if len(specs) > 1:
                raise InvalidArgument(
                    f"CDI device {name!r}: defined in both {specs[0].path} and {specs[1].path}"
                )
            if kind_broken:
                raise InvalidArgument(f"CDI device {name!r}: {kind_broken[0]}")
            resolved.append(ResolvedDevice(name, specs[0], edits))
        return resolved

    def inject(self, spec: dict[str, Any], cfg: api_pb2.ContainerConfig) -> None:
        """Apply the edits of the devices `cfg` asks for to `spec`, in place."""
        devices = self.resolve(requested_devices(cfg))
        if devices:
            apply_edits(spec, device_edits(devices))


def device_edits(devices: Sequence[ResolvedDevice]) -> list[tuple[str, ContainerEdits]]:
    """The edits to apply, each labelled with its device: a spec file's own edits once,
    before those of its first device asked for, then each device's."""
    edits: list[tuple[str, ContainerEdits]] = []
    files_seen: set[Path] = set()
    for device in devices:
        if device.spec.path not in files_seen:
            files_seen.add(device.spec.path)
            edits.append((device.name, device.spec.edits))
        edits.append((device.name, device.edits))
    return edits


# ---- applying --------------------------------------------------------------------------


def apply_edits(
    spec: dict[str, Any],
    edits: Iterable[tuple[str, ContainerEdits]],
    *,
    stat_path: Any = os.stat,
) -> None:
    """Apply container edits to an OCI spec in place. A device node whose type or numbers
    are not given is looked up on the host (`stat_path`); InvalidArgument names the device
    when that fails."""
    process = spec.setdefault("process", {})
    linux = spec.setdefault("linux", {})
    for device, edit in edits:
        for item in edit.env:
            _set_env(process, item)
        for node in edit.device_nodes:
            _add_device_node(linux, _complete_node(device, node, stat_path))
        for mount in edit.mounts:
            _add_mount(spec, mount)
        for hook in edit.hooks:
            entry: dict[str, Any] = {"path": hook.path}
            if hook.args:
                entry["args"] = list(hook.args)
            if hook.env:
                entry["env"] = list(hook.env)
            if hook.timeout is not None:
                entry["timeout"] = hook.timeout
            spec.setdefault("hooks", {}).setdefault(hook.hook_name, []).append(entry)
        if edit.additional_gids:
            user = process.setdefault("user", {"uid": 0, "gid": 0})
            gids = user.setdefault("additionalGids", [])
            # Group 0 is never added by a device (the CDI library drops it too).
            gids.extend(g for g in edit.additional_gids if g and g not in gids)
        if edit.intel_rdt:
            linux["intelRdt"] = dict(edit.intel_rdt)


def _set_env(process: dict[str, Any], item: str) -> None:
    key = item.split("=", 1)[0] + "="
    env = process.setdefault("env", [])
    for index, existing in enumerate(env):
        if existing.startswith(key):
            env[index] = item
            return
    env.append(item)


def _complete_node(device: str, node: DeviceNode, stat_path: Any) -> DeviceNode:
    """`node` with what the spec file left out (type, major, minor, mode) from the host."""
    needed = not node.type or (node.type != "p" and (node.major is None or node.minor is None))
    try:
        st = stat_path(node.host_path)
    except OSError as exc:
        if not needed:
            return node  # everything runc needs is given; the mode stays runc's default
        raise InvalidArgument(
            f"CDI device {device!r}: device node {node.host_path}: {exc.strerror}"
        ) from None
    if stat.S_ISCHR(st.st_mode):
        host_type = "c"
    elif stat.S_ISBLK(st.st_mode):
        host_type = "b"
    elif stat.S_ISFIFO(st.st_mode):
        host_type = "p"
    elif needed:
        raise InvalidArgument(f"CDI device {device!r}: {node.host_path} is not a device node")
    else:
        return node
    return DeviceNode(
        path=node.path,
        host_path=node.host_path,
        type=node.type or host_type,
        major=node.major if node.major is not None else os.major(st.st_rdev),
        minor=node.minor if node.minor is not None else os.minor(st.st_rdev),
        file_mode=node.file_mode if node.file_mode is not None else stat.S_IMODE(st.st_mode),
        permissions=node.permissions,
        uid=node.uid,
        gid=node.gid,
    )


def _add_device_node(linux: dict[str, Any], node: DeviceNode) -> None:
    entry: dict[str, Any] = {"path": node.path, "type": node.type}
    if node.type != "p":
        entry["major"], entry["minor"] = node.major, node.minor
    if node.file_mode is not None:
        entry["fileMode"] = node.file_mode
    if node.uid is not None:
        entry["uid"] = node.uid
    if node.gid is not None:
        entry["gid"] = node.gid
    devices = [d for d in linux.get("devices", []) if d.get("path") != node.path]
    linux["devices"] = [*devices, entry]
    if node.type != "p":  # the device cgroup has no rules for fifos
        rules = linux.setdefault("resources", {}).setdefault("devices", [])
        rules.append(
            {
                "allow": True,
                "type": node.type,
                "major": node.major,
                "minor": node.minor,
                "access": node.permissions,
            }
        )


def _add_mount(spec: dict[str, Any], mount: Mount) -> None:
    options = list(mount.options)
    mount_type = mount.type
    if not mount_type:
        # A mount without a type is a bind mount of the host path (what plugins mean by it).
        mount_type = "bind"
        if "bind" not in options and "rbind" not in options:
            options.append("rbind")
    entry: dict[str, Any] = {
        "destination": mount.container_path,
        "type": mount_type,
        "source": mount.host_path,
        "options": options,
    }
    mounts = [m for m in spec.get("mounts", []) if m.get("destination") != mount.container_path]
    spec["mounts"] = [*mounts, entry]
