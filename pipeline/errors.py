"""Every error the pipeline raises on purpose derives from :class:`PipelineError`.

Expected errors are the ones a user can fix or wait out (bad configuration, bad input,
an unreachable server); the CLI prints them as one line and exits non-zero. Driver
errors (psycopg, SQLAlchemy, redis-py) are turned into these at one seam,
:func:`pipeline.driver_errors.wrap_driver_errors`, wherever the pipeline's own commands
talk to the servers; anything else that escapes is a bug and keeps its traceback::

    PipelineError                   an expected failure; its message is safe to show
    ├── ConfigurationError          a PIPELINE_* setting or schema name is invalid
    ├── EventValidationError        an event was rejected before any SQL ran (a ValueError)
    ├── EnvelopeError               a queued message is not a pipeline envelope (a ValueError)
    ├── UnknownConsumerError        a consumer name nobody registered (a LookupError)
    ├── NotFoundError               an id given by an operator matches nothing (a LookupError)
    ├── MigrationError              the schema is missing, newer than this code, or failed
    ├── PermissionDeniedError       the database role lacks a grant (docs/security.md)
    ├── PermanentPublishError       the broker can never take this delivery: dead-letter it
    ├── ServiceUnavailableError     Postgres or Redis did not answer; later may succeed
    │   └── PublisherUnavailable    the transport as a whole is down; no event is to blame
    ├── EmbeddedServerError         a throwaway test/demo server failed (a RuntimeError)
    │   ├── BinaryNotFoundError     no usable server binary; the message lists what was tried
    │   └── ServerStartError        the server exited or did not answer; ends with its log
    ├── DemoError                   ``pipeline demo`` could not run
    └── BacklogFull                 unsent events exceed PIPELINE_BACKLOG_LIMIT (nothing written)

The classes are re-exported where they are raised (``pipeline.envelope.EnvelopeError``,
``pipeline.transport.publisher.PublisherUnavailable``, ``pipeline.tools.harness.embedded``'s
server errors), so either import path works.
"""

from __future__ import annotations

from pipeline.redaction import redact_text


class PipelineError(Exception):
    """Base class: the message is safe to show to an operator (no payloads, no secrets)."""


class ConfigurationError(PipelineError):
    """A setting is missing or invalid; the message names the variable."""


class EventValidationError(PipelineError, ValueError):
    """An event was rejected before it touched the caller's transaction."""


class EnvelopeError(PipelineError, ValueError):
    """A message on a queue is not a pipeline envelope."""


class UnknownConsumerError(PipelineError, LookupError):
    """A consumer name is not in the registry of this process."""


class NotFoundError(PipelineError, LookupError):
    """An id given by an operator matches nothing."""


class MigrationError(PipelineError):
    """The schema is missing or newer than this code, or a migration failed."""


class PermissionDeniedError(PipelineError):
    """The database role lacks a privilege; the message names it (never the credentials)."""


class PermanentPublishError(PipelineError):
    """Delivery can never succeed (e.g. the message is too large): dead-letter at once."""


class ServiceUnavailableError(PipelineError):
    """A server the pipeline needs did not answer; retrying later may succeed."""


class PublisherUnavailable(ServiceUnavailableError):
    """The transport as a whole is down: no event is to blame, so no attempt is counted."""


class EmbeddedServerError(PipelineError, RuntimeError):
    """An embedded server could not be set up, started or stopped."""


class BinaryNotFoundError(EmbeddedServerError):
    """No usable server binary was found; the message lists every place that was tried."""


class ServerStartError(EmbeddedServerError):
    """The server exited or did not answer in time; the message ends with its log tail."""


class DemoError(PipelineError):
    """The demo could not run (a server did not start, a process died, a timeout)."""


class BacklogFull(PipelineError):
    """More unsent events than ``PIPELINE_BACKLOG_LIMIT``: the event was not written.

    Raised before any SQL of the insert, so the caller's transaction stays usable (commit
    its other work, or roll back and retry later).
    """


MAX_ERROR_LENGTH = 2000


def error_text(exc: BaseException) -> str:
    """How a failure is stored (attempts, dead letters): class and message, bounded in size,
    with the secrets of any URL it quotes masked (an HTTP client's error names the URL it
    called, ``?api_key=`` and all): whoever reads dead letters need not hold the secrets."""
    return redact_text(f"{type(exc).__name__}: {exc}")[:MAX_ERROR_LENGTH]
