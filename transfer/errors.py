"""The errors a KV transfer raises on the client side.

Each names what went wrong and carries the gRPC status a daemon should answer
its own caller with (``code``): a contract mismatch is FAILED_PRECONDITION, a
chunk that arrived damaged DATA_LOSS, a server's status its own code.
"""

from __future__ import annotations

import grpc
from lanekv.transfer.protocol.fielddiff import FieldDiff

Code = grpc.StatusCode


class TransferError(RuntimeError):
    """Base of the errors a transfer raises; a server broke the protocol when nothing more precise fits."""

    code = Code.ABORTED


class ContractMismatch(TransferError):
    """The server refused our contract; ``diffs`` compare ours (client) with theirs (server)."""

    code = Code.FAILED_PRECONDITION

    def __init__(self, diffs: list[FieldDiff], message: str) -> None:
        super().__init__(message)
        self.diffs = diffs


class CorruptChunk(TransferError):
    """A chunk arrived damaged: its message or header does not parse, or is not the chunk asked for."""

    code = Code.DATA_LOSS

    def __init__(self, request_id: str, rank: int, seq: int, what: str) -> None:
        super().__init__(f"request {request_id!r}: chunk {seq} from rank {rank} {what}")
        self.request_id, self.rank, self.seq = request_id, rank, seq


class ChecksumError(CorruptChunk):
    """A chunk's payload does not match its checksum (or its announced size)."""

    def __init__(self, request_id: str, rank: int, seq: int) -> None:
        super().__init__(request_id, rank, seq, "failed its checksum")


class RemoteError(TransferError):
    """A gRPC status from a transfer server (``rank`` is None for a handshake).

    A stream the client cut because it stalled reads as DEADLINE_EXCEEDED.
    """

    def __init__(
        self, rank: int | None, endpoint: str, code: grpc.StatusCode, details: str
    ) -> None:
        where = endpoint if rank is None else f"rank {rank} ({endpoint})"
        super().__init__(f"{where}: {code.name}: {details}")
        self.rank, self.endpoint, self.code, self.details = rank, endpoint, code, details
