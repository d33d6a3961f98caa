import socket


def free_port() -> int:
    """A TCP port nobody listens on now (torchrun's rendezvous; test sessions may run side by side)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
