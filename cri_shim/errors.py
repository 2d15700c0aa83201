"""Domain errors. Every layer raises these; only server/ turns them into gRPC statuses."""

from __future__ import annotations


class CriError(Exception):
    """Base of every error that reaches a client. The message must help a person act."""


class InvalidArgument(CriError):
    pass


class NotFound(CriError):
    pass


class AlreadyExists(CriError):
    pass


class NameReserved(AlreadyExists):
    """A creation with this name is in flight; the message names its stage."""


class FailedPrecondition(CriError):
    pass


class DeadlineExceeded(CriError):
    pass


class Unavailable(CriError):
    pass


class ResourceExhausted(CriError):
    pass


class PermissionDenied(CriError):
    pass


class Unauthenticated(CriError):
    pass


class Unimplemented(CriError):
    pass


class Internal(CriError):
    """A host operation failed (runc, CNI, mount); the message carries the tool's own words."""
