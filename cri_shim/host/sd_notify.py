"""sd_notify(3) without libsystemd: the daemon's state told to systemd (Type=notify).

Light on purpose: the command loads it before the daemon's modules, so that under socket
activation systemd hears READY=1 as soon as the activated socket is answered (cli.py).
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping


class SystemdNotifier:
    """One datagram per message to $NOTIFY_SOCKET; a no-op where systemd set none.

    The address is taken out of the environment when the notifier is made, as
    sd_notify(unset_environment=1) does: everything the daemon starts (runc, conmon, CNI
    and NRI plugins) would otherwise inherit it, and runc reads a NOTIFY_SOCKET in its
    environment as the container's own, binds a relay for it under its state directory
    and holds `runc start` until the container says READY=1.
    """

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        self.address = (os.environ if environ is None else environ).pop("NOTIFY_SOCKET", None)
        self.ready_sent = False

    def notify(self, message: str) -> None:
        if not self.address:
            return
        address = self.address
        if address.startswith("@"):
            address = "\0" + address[1:]
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())

    def ready(self, status: str) -> None:
        """READY=1 with `status` the first time (the start job ends), `status` alone after."""
        self.notify(f"STATUS={status}" if self.ready_sent else f"READY=1\nSTATUS={status}")
        self.ready_sent = True
