"""A fake CNI plugin that tests write into a bin dir: it logs each call and obeys its config.

The fake is driven by keys of its own plugin config, so that one script serves every test:
  "result":  the JSON printed on ADD (default: prevResult, or an empty result)
  "error":   a CNI error JSON printed, with exit status 1, on the commands in "failOn"
             (default ADD and DEL)
  "stderr":  text written to stderr
  "sleep":   seconds to sleep on ADD before answering
  "child":   if true, start a `sleep` child that inherits stdout (a stuck helper); its
             pid is logged as a {"command": "child"} line
  "raw":     text printed verbatim instead of a result
Every call appends {"command", "env", "stdin", "pid"} as one JSON line to calls.jsonl.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

FAKE_PLUGIN = """#!{python}
import json, os, subprocess, sys, time
conf = json.load(sys.stdin)
command = os.environ["CNI_COMMAND"]
env = {{k: v for k, v in os.environ.items() if k.startswith("CNI_")}}
with open({log!r}, "a") as f:
    f.write(json.dumps({{"command": command, "env": env, "stdin": conf, "pid": os.getpid()}}))
    f.write("\\n")
if conf.get("stderr"):
    sys.stderr.write(conf["stderr"])
if command == "ADD" and conf.get("child"):
    child = subprocess.Popen(["sleep", "60"])
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"command": "child", "pid": child.pid}}) + "\\n")
if command == "ADD" and conf.get("sleep"):
    time.sleep(conf["sleep"])
if conf.get("error") and command in conf.get("failOn", ["ADD", "DEL"]):
    print(json.dumps(conf["error"]))
    sys.exit(1)
if conf.get("raw") is not None:
    print(conf["raw"])
elif command == "ADD":
    empty = {{"cniVersion": conf["cniVersion"]}}
    print(json.dumps(conf.get("result") or conf.get("prevResult") or empty))
"""


class FakeCni:
    """A config dir, a bin dir holding fake plugins, and the log of their calls."""

    def __init__(self, root: Path) -> None:
        self.config_dir = root / "net.d"
        self.bin_dir = root / "bin"
        self.log = root / "calls.jsonl"
        self.config_dir.mkdir()
        self.bin_dir.mkdir()

    def plugin(self, name: str) -> Path:
        path = self.bin_dir / name
        path.write_text(FAKE_PLUGIN.format(python=sys.executable, log=str(self.log)))
        path.chmod(0o755)
        return path

    def write_conflist(
        self,
        plugins: list[dict[str, Any]],
        name: str = "fake-net",
        filename: str = "10-fake.conflist",
        version: str = "1.0.0",
    ) -> Path:
        for plugin in plugins:
            if not (self.bin_dir / plugin["type"]).exists():
                self.plugin(plugin["type"])
        path = self.config_dir / filename
        path.write_text(json.dumps({"cniVersion": version, "name": name, "plugins": plugins}))
        return path

    def calls(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]
