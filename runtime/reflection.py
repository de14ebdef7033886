"""gRPC server reflection on every lanekv port, for grpcurl and grpcui.

``runtime.security.make_server`` wraps each server it makes in a
``ReflectingServer``: it notes the name of every service added to it and, at
``start``, adds the reflection service listing exactly those (and itself).
Reflection is an ordinary service behind the server's interceptors, so it
needs the token like the lanekv services do; only health stays open.
Without the grpcio-reflection package (a machine set up by hand rather than
from pyproject) the server starts without reflection and logs so.
"""

from __future__ import annotations

import logging

import grpc

log = logging.getLogger(__name__)


class ReflectingServer(grpc.Server):
    """A ``grpc.Server`` that answers reflection for the services registered on it."""

    def __init__(self, server: grpc.Server) -> None:
        self._server = server
        self._services: list[str] = []
        self._reflecting = False

    @property
    def services(self) -> tuple[str, ...]:
        """The services added so far, in order."""
        return tuple(self._services)

    def _note(self, name: str) -> None:
        if name not in self._services:
            self._services.append(name)

    def add_generic_rpc_handlers(self, generic_rpc_handlers):
        for handler in generic_rpc_handlers:
            name = getattr(handler, "service_name", None)
            if callable(name):
                self._note(name())
        return self._server.add_generic_rpc_handlers(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name, method_handlers):
        self._note(service_name)
        return self._server.add_registered_method_handlers(service_name, method_handlers)

    def add_insecure_port(self, address):
        return self._server.add_insecure_port(address)

    def add_secure_port(self, address, server_credentials):
        return self._server.add_secure_port(address, server_credentials)

    def start(self):
        if not self._reflecting:  # handlers can only be added before the server starts
            self._reflecting = True
            try:
                from grpc_reflection.v1alpha import reflection
            except ImportError:
                log.warning("grpcio-reflection is not installed: this server answers no reflection "
                            "(services: %s)", ", ".join(self._services))
            else:
                reflection.enable_server_reflection((*self._services, reflection.SERVICE_NAME),
                                                    self._server)
        return self._server.start()

    def stop(self, grace):
        return self._server.stop(grace)

    def wait_for_termination(self, timeout=None):
        return self._server.wait_for_termination(timeout)
