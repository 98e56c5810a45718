"""Every error the pipeline raises on purpose derives from :class:`PipelineError`.

Expected errors are the ones a user can fix (bad configuration, bad input, an
unreachable server); the CLI prints them as one line and exits non-zero::

    PipelineError
    ├── ConfigurationError        a PIPELINE_* setting or schema name is invalid
    ├── EventValidationError      a payload or event field was rejected before any SQL ran
    ├── UnknownConsumerError      a message or command names a consumer nobody registered
    ├── ServiceUnavailableError   Postgres or Redis could not be reached (driver error wrapped)
    ├── MigrationError            the database schema could not be brought up to date
    ├── PermissionDeniedError     the database role lacks a grant (docs/security.md)
    ├── NotFoundError             an event or dead letter named by an operator does not exist
    └── BacklogFull               unsent events exceed PIPELINE_BACKLOG_LIMIT (nothing written)
"""

from __future__ import annotations


class PipelineError(Exception):
    """Base class: the message is safe to show to an operator (no payloads, no secrets)."""


class ConfigurationError(PipelineError):
    """A setting is missing or invalid; the message names the variable."""


class EventValidationError(PipelineError, ValueError):
    """An event was rejected before it touched the caller's transaction."""


class UnknownConsumerError(PipelineError, LookupError):
    """A consumer name is not in the registry of this process."""


class ServiceUnavailableError(PipelineError):
    """A server the pipeline needs did not answer; retrying later may succeed."""


class MigrationError(PipelineError):
    """The schema is newer than this code, or a migration failed."""


class PermissionDeniedError(PipelineError):
    """The database role lacks a privilege; the message names it (never the credentials)."""


class NotFoundError(PipelineError, LookupError):
    """An id given by an operator matches nothing."""


class BacklogFull(PipelineError):
    """More unsent events than ``PIPELINE_BACKLOG_LIMIT``: the event was not written.

    Raised before any SQL of the insert, so the caller's transaction stays usable (commit
    its other work, or roll back and retry later).
    """


MAX_ERROR_LENGTH = 2000


def error_text(exc: BaseException) -> str:
    """How a failure is stored (attempts, dead letters): class and message, bounded in size."""
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_LENGTH]
