"""gRPC front of the sidecar: thin servicers, one interceptor for errors and auth."""

from sidecar.server.app import SidecarServer, serve

__all__ = ["SidecarServer", "serve"]
