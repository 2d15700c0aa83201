"""The configuration written out: the effective one as TOML (`cri-shim config`) and the
reference of every key (`cri-shim config --reference`), generated into docs/ and contrib/.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from cri_shim.config.handlers_doc import runtime_handlers_markdown
from cri_shim.config.model import DURATION_KEYS, SIZE_KEYS, Config
from cri_shim.config.units import format_duration, format_size


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and value == int(value):
        return int(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if getattr(value, f.name) is not None
        }
    return value


def config_to_toml(cfg: Config) -> str:
    data = _plain(cfg)
    for section, key in DURATION_KEYS:
        data[section][key] = format_duration(getattr(getattr(cfg, section), key))
    for section, key in SIZE_KEYS:
        table = data[section] if section else data
        table[key] = format_size(getattr(getattr(cfg, section) if section else cfg, key))
    return tomli_w.dumps(data)


# What each key means, keyed by its dotted path (NAME stands for any handler name). A test
# fails when a key has no entry here, or an entry names no key, or the generated files
# (docs/configuration.md, contrib/config.toml) are stale: the reference cannot drift.
KEY_DOCS: dict[str, str] = {
    "listen": "the CRI socket kubelet and crictl connect to (created mode 0660)",
    "root": "state: `state.db`, sandbox directories, images",
    "run_root": "runtime files: namespace pins, conmon sockets, runtime state",
    "log_level": "`debug`, `info`, `warning` or `error` (the `--log-level` flag wins)",
    "log_format": "`logfmt` (key=value), `json` (one object per line) or `text` (for humans)",
    "cgroup_manager": "the cgroup driver, as kubelet's `--cgroup-driver` must be: `auto` "
    "(systemd when systemd is PID 1, that is /run/systemd/system exists, else cgroupfs), "
    "`systemd` (pods in slices, containers in scopes through runc's `--systemd-cgroup`; "
    "refused at start where systemd does not run) or `cgroupfs`",
    "conmon_cgroup": "with the systemd driver, the slice each conmon's transient scope "
    '(`cri-shim-conmon-<id>.scope`) goes in: `""` for `system.slice`, `pod` for the pod\'s '
    "slice, or a slice's name; refused with cgroupfs (conmon stays in the daemon's cgroup)",
    "max_message_bytes": "largest gRPC request accepted; a bigger one is refused with "
    "RESOURCE_EXHAUSTED before any handler reads it",
    "socket_group": "group (name or number) that owns the 0660 socket and so may connect; "
    '`""` leaves it root\'s',
    "network.config_dir": "CNI configurations; the lexically first one is used, re-read on "
    "SIGHUP and when the directory changes",
    "network.bin_dirs": "where CNI plugin binaries are looked up",
    "network.setup_timeout": "budget of a sandbox's CNI ADD, independent of the request's deadline",
    "network.teardown_timeout": "budget of a CNI DEL",
    "creation.claim_grace": "how long a finished but unclaimed object is kept after the last "
    "waiting request's deadline",
    "creation.keep_on_timeout": "`false` throws timed-out work away and refuses duplicates at once "
    "(containerd's behaviour, for comparison)",
    "creation.hand_off": "a duplicate request waiting on a creation gets the object as soon as "
    'it is finished within its deadline; `false` answers it "name is reserved" and only its '
    "next retry gets the object (CRI-O's behaviour, for comparison). No effect when "
    "`keep_on_timeout` is `false`",
    "creation.cleanup_timeout": "budget of one object's cleanup (each step retried with backoff)",
    "runtime.default_handler": "the handler used when a request names none",
    "runtime.conmon": "the conmon binary",
    "runtime.stop_timeout_grace": "extra time after SIGKILL before a stop is reported failed",
    "runtime.handlers.NAME.path": "the OCI runtime binary (runc, crun) of handler NAME",
    "runtime.handlers.NAME.root": "that runtime's `--root` state directory",
    "runtime.handlers.NAME.runtime_args": "global options given to every call of that "
    'runtime, before the command (`runtime_args = ["--network=host"]` for gVisor on a '
    "kernel whose network namespaces show `/proc/sys/net/core/rmem_default`, Linux 6.11 and "
    "newer, where runsc releases before August 2024 refuse their own network stack)",
    "runtime.handlers.NAME.pod_sandbox": "`true`: the runtime runs a pod as one sandbox that "
    "its containers join (gVisor's `runsc`, Kata Containers), so each pod gets a sandbox "
    "container (the daemon's static pause program, `io.kubernetes.cri.container-type: "
    "sandbox`) created first, in the pod's network namespace, and removed last; `false`: "
    "pods have no process of their own (runc, crun)",
    "images.insecure_registries": "registries reached over plain HTTP",
    "images.mirrors": "registry → mirror endpoints tried in order before it, e.g. "
    '`{ "docker.io" = ["http://127.0.0.1:5000"] }`',
    "images.max_layer_bytes": "largest uncompressed layer (stream and file content); a bigger "
    "one (a decompression bomb) fails the pull or import naming this key",
    "images.max_layer_entries": "most entries (files, directories, links) in one layer; more "
    "fail the pull or import naming this key",
    "images.allow_device_nodes": "`true` keeps character and block devices found in layers; "
    "`false` refuses such a layer (overlay whiteouts, 0/0 character devices, are always kept)",
    "images.max_concurrent_downloads": "layer downloads the daemon runs at once, all registries "
    "together; more wait for a slot",
    "images.max_downloads_per_registry": "of those, how many one registry may hold, so that a "
    "slow registry cannot take every slot",
    "images.download_timeout": "budget of one layer download, from its first request to its "
    "last byte; a download past it fails UNAVAILABLE naming this key",
    "images.download_min_rate": "slowest a layer download may be (bytes a second, averaged over "
    "`download_rate_window`); a slower one is cut off and fails UNAVAILABLE naming this key; "
    '`"0B"` turns the check off',
    "images.download_rate_window": "how long the rate of a download is averaged over before it "
    "is judged against `download_min_rate`",
    "requests.max_in_flight": "CRI calls that do host work (create, start, stop, remove, exec, "
    "pull) running at once, and sandbox or container creations still running detached",
    "requests.max_queued": "such calls waiting for a slot; a call beyond both limits is refused "
    "with RESOURCE_EXHAUSTED",
    "requests.max_reads_in_flight": "calls answered from the state (list, status, stats, "
    "version) running at once; more are refused with RESOURCE_EXHAUSTED",
    "requests.max_streams_in_flight": "streaming lists (`StreamPodSandboxes`, "
    "`StreamContainers`, `StreamContainerStats`, ...) open at once, counted apart from the "
    "reads so that streams a client leaves unread never hold up Version, Status or a list; "
    "more are refused with RESOURCE_EXHAUSTED",
    "requests.stream_write_timeout": "how long one message of a streaming list may wait "
    "for the client to read it; a stream whose client reads nothing for this long is "
    "cancelled (logged naming this key), and its place given back",
    "requests.max_reply_bytes_in_flight": "memory held for replies gRPC has not yet sent, "
    "all calls together, counted at what the daemon holds for each (twice its bytes, its "
    "serialization and gRPC core's copy, and about 20 KiB for the call) until its call "
    "ends; a reply that would pass this while others wait for their clients is refused "
    "with RESOURCE_EXHAUSTED naming this key (a single reply always goes)",
    "events.max_subscribers": "`GetContainerEvents` streams open at once (kubelet opens one, "
    "`crictl events` one each); one more is refused with RESOURCE_EXHAUSTED naming this key",
    "events.max_backlog_bytes": "bytes of events one stream may leave unread (each event is "
    "serialized once and shared by every stream); a stream behind by more is dropped: it "
    "ends with RESOURCE_EXHAUSTED naming this key, or is cancelled when it reads nothing at "
    "all, and its client subscribes again and relists, as kubelet does",
    "metrics.listen": 'Prometheus endpoint (`/metrics`), e.g. `127.0.0.1:9090`; `""` is off',
    "metrics.event_loop_sample_interval": "how often the event loop's lag is sampled while a "
    "CRI call is served, shown in Status (verbose) as `eventLoop` and exported as "
    "`cri_shim_event_loop_lag_seconds`; between calls once a second, paused after 10 s "
    "without one; a stall longer than a second is always seen; 0 is off",
    "metrics.layer_usage_max_age": "how old a container's writable-layer disk use may be "
    "before ContainerStats, PodSandboxStats (and their lists) or ListPodSandboxMetrics walk "
    "the layer again; a reused figure keeps the timestamp of its walk, as containerd's "
    "figures refreshed every 10 s do; 0 walks the layer at every call",
    "streaming.address": "host:port of the exec/attach/port-forward server whose URLs the "
    "streaming RPCs return; port 0 picks a free port, loopback suffices as kubelet proxies",
    "streaming.tls_cert": "PEM certificate to serve the streaming URLs over HTTPS (with `tls_key`)",
    "streaming.tls_key": "PEM private key of `tls_cert`; both or neither",
    "cdi.spec_dirs": "directories of CDI spec files (`*.json`, `*.yaml`) that resolve the "
    "devices a container asks for (`cdi_devices`, `cdi.k8s.io/*` annotations); a later "
    "directory overrides an earlier one for the same device; files are re-read when changed",
    "nri.enable": "serve NRI (Node Resource Interface) plugins on `socket_path`; a plugin sees "
    "every pod and container event and may adjust a container before it is created, or fail "
    "its creation",
    "nri.socket_path": "unix socket NRI plugins connect to (made 0600)",
    "nri.plugin_registration_timeout": "time a connecting plugin has to register, and again "
    "to answer its synchronization (in all its messages; no event waits for it, events that "
    "come meanwhile are told to it after); a plugin that does not is disconnected",
    "nri.plugin_request_timeout": "time a plugin has to read and answer each other call "
    "(configuration, every event); a plugin that does not is disconnected and the event goes "
    "on without it, so it costs a creation at most this once",
    "nri.plugin_path": "directory of pre-installed plugins: every executable named `NN-name` "
    "(two-digit index, dash, name) is started by the daemon when NRI is enabled, connected "
    "over an inherited socket (its fd in `NRI_PLUGIN_SOCKET`), and stopped with the daemon; "
    "one that exits is logged, not restarted",
    "nri.plugin_config_path": "directory of pre-installed plugins' configuration: "
    "`NN-name.conf`, else `name.conf` (a regular file of at most 1 MiB of UTF-8; any other "
    "is logged and that plugin not started), is sent to the plugin when it is configured",
    "tracing.endpoint": "OTLP/HTTP base URL of an OpenTelemetry collector (Jaeger, Tempo, the "
    "OpenTelemetry Collector), e.g. `http://127.0.0.1:4318`; spans are POSTed as protobuf to "
    '`<endpoint>/v1/traces`; `""` is off (nothing of OpenTelemetry is loaded)',
    "tracing.sampling_ratio": "share of traces recorded (0 to 1), whoever started them: a "
    "trace is recorded when its ID falls within the ratio (OpenTelemetry's TraceIdRatioBased "
    "rule, so a caller sampling with it at a lower ratio has each of its sampled traces "
    "recorded here too) and the caller's `traceparent`, if any, does not say not sampled; a "
    "caller's sampled `traceparent` never records more than the ratio, so 0 records nothing; "
    "a creation is recorded with the request that started it",
    "tracing.service_name": "`service.name` of the exported spans",
    "tracing.max_queued_spans": "spans waiting for export; beyond it the oldest are dropped, "
    "so an unreachable collector costs at most this much memory",
    "tracing.max_queued_bytes": "bytes of spans waiting for export (their attributes, events "
    "and links, and a fixed part per span); beyond it the oldest are dropped, as beyond "
    "`max_queued_spans`",
    "tracing.export_timeout": "how long one export to the collector may take in all "
    "(resolving its name, connecting, the TLS handshake, sending, reading the answer, of "
    "which at most 64 KiB is read) before it fails (counted in Status verbose as "
    "`tracing.failed`)",
}

# Defaults that are computed rather than fixed, as the reference shows them.
_COMPUTED_DEFAULTS = {
    "runtime.handlers.NAME.path": "NAME",
    "runtime.handlers.NAME.root": "`<run_root>/runtime/NAME`",
    "runtime.handlers.NAME.runtime_args": "global options given to every call of that "
    'runtime, before the command (`runtime_args = ["--network=host"]` for gVisor on a '
    "kernel whose network namespaces show `/proc/sys/net/core/rmem_default`, Linux 6.11 and "
    "newer, where runsc releases before August 2024 refuse their own network stack)",
    "runtime.handlers.NAME.pod_sandbox": "`true` where `path` is gVisor's (`runsc "
    "--version`) or Kata's (`kata-runtime`, `containerd-shim-kata-v2`): the handler's kind",
}


@dataclass(frozen=True)
class ConfigKey:
    """One key of the configuration file, as the reference lists it."""

    section: str  # "" at the top level; "runtime.handlers.NAME" for per-name tables
    name: str
    kind: str  # what value it takes, for the reference
    default: str | None  # the default as a TOML literal; None when it is computed
    example_section: str  # `section` with NAME replaced by the default name ("runc")

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name


def config_keys() -> list[ConfigKey]:
    """Every key the file accepts, read from the dataclasses: a table's keys before its
    sub-tables, as TOML needs them."""
    keys: list[ConfigKey] = []
    _walk_keys(Config, Config(), "", "", keys)
    return keys


def _walk_keys(
    cls: type, instance: object, section: str, example: str, out: list[ConfigKey]
) -> None:
    hints = typing.get_type_hints(cls)
    tables: list[tuple[Any, object, str, str]] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        value = getattr(instance, f.name) if instance is not None else None
        args = typing.get_args(hint)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            tables.append((hint, value, _join(section, f.name), _join(example, f.name)))
        elif typing.get_origin(hint) is dict and dataclasses.is_dataclass(args[1]):
            # A table per name ([runtime.handlers.NAME]); the default entry is the example.
            first = next(iter(value.items()), None) if isinstance(value, dict) else None
            name, item = first if first is not None else ("NAME", None)
            tables.append(
                (
                    args[1],
                    item,
                    _join(section, f.name) + ".NAME",
                    _join(example, f"{f.name}.{name}"),
                )
            )
        else:
            default = None if value is None else _toml_literal(value, (section, f.name))
            out.append(ConfigKey(section, f.name, _kind(hint, (section, f.name)), default, example))
    for table in tables:
        _walk_keys(*table, out)


def _join(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name


def _kind(hint: object, where: tuple[str, str]) -> str:
    if where in DURATION_KEYS:
        return "duration"
    if where in SIZE_KEYS:
        return "size"
    simple = {str: "string", bool: "boolean", Path: "path", float: "number", int: "integer"}
    if hint in simple:
        return simple[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return f"list of {_kind(args[0], where)}s"
    if origin is dict:
        return f"table of {_kind(args[1], where)}"
    if type(None) in args:  # Optional[X]
        return _kind(next(a for a in args if a is not type(None)), where)
    raise TypeError(f"config reference: no name for the type {hint!r} of {'.'.join(where)}")


def _toml_literal(value: object, where: tuple[str, str]) -> str:
    if where in DURATION_KEYS:
        assert isinstance(value, float | int)
        value = format_duration(value)
    if where in SIZE_KEYS:
        assert isinstance(value, int)
        value = format_size(value)
    return _literal(_plain(value))


def _literal(value: object) -> str:
    """One line of TOML for a plain value (tomli_w would spread arrays over lines)."""
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_literal(k)} = {_literal(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    return tomli_w.dumps({"v": value}).removeprefix("v = ").strip()


def config_reference_markdown() -> str:
    """docs/configuration.md: every key, its type, default and meaning."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `cri-shim config --reference` from cri_shim/config/; do not edit. -->",
        "",
        "TOML, default `/etc/cri-shim/config.toml` (optional; `--config PATH` names another).",
        "Every key is optional; an unknown key or a bad value stops the start with a message",
        'that names the key. Durations are strings such as `"90s"`, `"5m"`, `"250ms"` or',
        "integer seconds. The flags `--listen`, `--root`, `--run-root`, `--log-level` and",
        "`--log-format` win over the file. `contrib/config.toml` lists the same keys with",
        "their defaults, commented out. `cri-shim config` prints the effective configuration.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for key in config_keys():
        shown = f"[{key.section}] {key.name}" if key.section else key.name
        default = _COMPUTED_DEFAULTS.get(key.path) or (
            f"`{key.default}`" if key.default is not None else "unset"
        )
        meaning = KEY_DOCS.get(key.path, "**undocumented**").replace("|", "\\|")
        lines.append(f"| `{shown}` | {key.kind} | {default} | {meaning} |")
    return "\n".join(lines) + "\n" + runtime_handlers_markdown()


def config_reference_toml() -> str:
    """contrib/config.toml: every key with its meaning, the default commented out."""
    out = [
        "# cri-shim configuration (/etc/cri-shim/config.toml).",
        "# Generated by `cri-shim config --reference --toml`; the reference is",
        "# docs/configuration.md. Every key is optional: each commented-out value below is",
        "# the built-in default. Uncomment a line to change it.",
    ]
    section = None
    for key in config_keys():
        if key.example_section != section:
            section = key.example_section
            out += ["", f"[{section}]"] if section else []
        # The per-name table is shown for the default name: NAME means that name there.
        name = key.example_section.rsplit(".", 1)[-1] if key.section.endswith(".NAME") else "NAME"
        meaning = re.sub(r"`([^`]*)`", r"\1", KEY_DOCS.get(key.path, "undocumented"))
        if key.default is None:
            computed = _COMPUTED_DEFAULTS.get(key.path, "unset").strip("`")
            meaning += f" (default: {computed})"
        out.append("")
        out += textwrap.wrap(
            f"{key.name}: {meaning}".replace("NAME", name),
            width=88,
            initial_indent="# ",
            subsequent_indent="# ",
        )
        if key.default is not None:
            out.append(f"#{key.name} = {key.default}")
    return "\n".join(out) + "\n"
