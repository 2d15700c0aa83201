"""The CRI socket: bound by the daemon, or passed by systemd and relayed to the gRPC
server, with the HTTP/2 framing that holds and drains calls across a restart."""
