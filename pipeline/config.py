"""Typed settings read from ``PIPELINE_*`` environment variables.

Settings are read when a process asks for them (:func:`get_settings`), never at
import time, so tests and embedding applications can pass their own
:class:`Settings`. Secrets (passwords in URLs) never appear in error messages or
``repr``: use :func:`redact_url` (from :mod:`pipeline.redaction`) whenever a URL is shown.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Annotated, Any, Literal, Self
from urllib.parse import parse_qsl, unquote, urlsplit

from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

from pipeline.errors import ConfigurationError
from pipeline.redaction import redact_secrets

ENV_PREFIX = "PIPELINE_"
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
EVENT_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,199}$")
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_HOST = re.compile(r"^[A-Za-z0-9._:%\[\]-]+$")
# (lower, upper) settings that bound one range: the lower may not exceed the upper.
BOUNDS = (
    ("poll_interval_min", "poll_interval_max"),
    ("poll_interval_busy", "poll_interval_max"),
    ("publish_backoff_base", "publish_backoff_max"),
    ("consumer_backoff_min", "consumer_backoff_max"),
    ("heartbeat_stale_seconds", "heartbeat_gone_seconds"),
)

MESSAGE_KEY_OFF = frozenset({"insecure", "none"})  # PIPELINE_MESSAGE_KEY values: no signing
MESSAGE_KEY_MIN_CHARS = 32
AMQP_URL_PREFIXES = ("amqp://", "amqps://")
BROKER_URL_PREFIXES = ("redis://", "rediss://", "unix://", "redis+sentinel://", *AMQP_URL_PREFIXES)

# Every number has both bounds: a value past them could never work (a sleep of inf, a
# batch of three billion rows), and NaN or infinity is never a setting.
MAX_COUNT = 2**31 - 1  # what an int column and a Redis/Dramatiq count can hold
MAX_INTERVAL = 7 * 24 * 3600.0  # seconds a loop may sleep, a lease or a backoff may last
MAX_AGE = 100 * 365 * 24 * 3600  # seconds of retention
MAX_PAYLOAD_CEILING = 256 * 1024  # the outbox table refuses larger payloads (functions.sql)
PositiveInt = Annotated[int, Field(gt=0, le=MAX_COUNT)]
PositiveFloat = Annotated[float, Field(gt=0, le=MAX_INTERVAL, allow_inf_nan=False)]
Seconds = PositiveFloat
SecondsOrOff = Annotated[float, Field(ge=0, le=MAX_INTERVAL, allow_inf_nan=False)]  # 0: off
Age = Annotated[int, Field(gt=0, le=MAX_AGE)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]


def validate_identifier(value: str, what: str = "identifier") -> str:
    """Accept only lower-case SQL identifiers, so they never need quoting tricks."""
    if not _IDENTIFIER.fullmatch(value):
        raise ConfigurationError(
            f"invalid {what} {value!r}: use 1-63 characters of a-z, 0-9 and _, "
            "not starting with a digit"
        )
    return value


class Settings(BaseSettings):
    """All tunables of the pipeline; every field maps to ``PIPELINE_<FIELD>``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, extra="ignore", hide_input_in_errors=True
    )

    database_url: SecretStr | None = None
    redis_url: SecretStr | None = None  # the older name of broker_url (an alias)
    schema_name: str = "pipeline"
    redis_namespace: str = "pipeline"
    app_modules: str = ""  # comma-separated modules that register consumers

    # Producer
    max_payload_bytes: Annotated[int, Field(gt=0, le=MAX_PAYLOAD_CEILING)] = MAX_PAYLOAD_CEILING
    unordered_event_types: Annotated[frozenset[str], NoDecode] = frozenset()

    # Relay and publishing
    batch_size: Annotated[int, Field(gt=0, le=100_000)] = 500
    max_events_per_message: Annotated[int, Field(gt=0, le=100_000)] = 100
    lease_seconds: Seconds = 30.0
    poll_interval_busy: Seconds = 0.005
    busy_poll_rate: Annotated[float, Field(gt=0, le=1e9, allow_inf_nan=False)] = (
        500.0  # events/s from which the relay polls, not NOTIFY
    )
    poll_interval_min: Seconds = 0.05
    poll_interval_max: Seconds = 2.0
    reconnect_backoff_max: Seconds = 10.0
    publishers_in_flight: Annotated[int, Field(gt=0, le=1024)] = 4
    publish_max_attempts: PositiveInt = 12
    publish_backoff_base: Seconds = 0.5
    publish_backoff_max: Seconds = 300.0

    # Workers and inbox
    # A worker's wait on Redis must end well inside the client's socket timeout (5 s).
    worker_timeout_ms: Annotated[int, Field(gt=0, le=1000)] = 1000
    broker_heartbeat_timeout_ms: Annotated[int, Field(gt=0, le=int(MAX_INTERVAL * 1000))] = 60_000
    broker_maintenance_chance: Annotated[int, Field(ge=0, le=1_000_000)] = 1000
    # Redis only: finished message ids remembered per queue, so a leftover id on the queue
    # is told apart (a duplicate, dropped) from a delivery whose body is gone (left to the
    # ledger); about 120 bytes of Redis each
    finished_ids_kept: Annotated[int, Field(ge=1000, le=10_000_000)] = 50_000
    inbox_retention_seconds: Age = 7 * 24 * 3600
    consumer_max_retries: Count = 8
    consumer_backoff_min: Seconds = 0.2
    consumer_backoff_max: Seconds = 60.0

    # Observability
    metrics_host: str = "127.0.0.1"
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 9464  # relay; 0 disables
    worker_metrics_port: Annotated[int, Field(ge=0, le=65535)] = 9465  # pipeline worker
    metrics_multiproc_dir: str | None = None  # default: PROMETHEUS_MULTIPROC_DIR or a temp dir
    state_metrics_interval: Seconds = 5.0  # seconds between the relay's state queries
    log_format: Literal["json", "console"] = "console"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    trace_ui_url: str | None = None
    canary_interval: SecondsOrOff = 15.0  # seconds; 0 turns the canary off
    # Relays and workers refresh their heartbeat row every 2 s, idle or busy: a row this
    # old is stale (stuck, paused, cut off from Postgres), then gone (outlived its process)
    heartbeat_stale_seconds: Annotated[float, Field(ge=5, le=MAX_INTERVAL, allow_inf_nan=False)] = (
        10.0
    )
    heartbeat_gone_seconds: Annotated[float, Field(ge=5, le=MAX_INTERVAL, allow_inf_nan=False)] = (
        60.0
    )

    # Message broker (transport). PIPELINE_BROKER_URL picks it by scheme: redis://, rediss://,
    # unix:// (Dramatiq on Redis) or amqp://, amqps:// (Dramatiq on RabbitMQ, quorum queues,
    # publisher confirms). PIPELINE_REDIS_URL is the older name of the same setting.
    broker_url: SecretStr | None = None
    # RabbitMQ only: the management API (queue listing, doctor checks); default: the broker's
    # host on port 15672 with the broker URL's credentials.
    broker_management_url: SecretStr | None = None
    # RabbitMQ only: the server's consumer_timeout (a delivery held unacknowledged longer is
    # given back and its channel closed); workers hold a delayed message at most half of it,
    # and `pipeline doctor` compares it with handler limits.
    broker_consumer_timeout_ms: PositiveInt = 1_800_000
    broker_prefetch_max: PositiveInt = 1000  # RabbitMQ only: prefetch bound per consumer
    broker_confirm_timeout: PositiveFloat = 30.0  # RabbitMQ only: seconds to wait for confirms

    # Delivery ledger: Postgres knows what each consumer is owed; Redis only carries it
    redelivery_horizon_seconds: Seconds = 60.0  # an outcome overdue this long: send again
    reconcile_interval_seconds: Seconds = 5.0  # seconds between the relay's ledger sweeps

    # Retention: the relay's janitor deletes rows older than these ages (prune.py)
    sent_retention_seconds: Age = 7 * 24 * 3600
    attempts_retention_seconds: Age = 30 * 24 * 3600  # attempt and delivery history
    audit_retention_seconds: Age = 365 * 24 * 3600
    prune_interval_seconds: SecondsOrOff = 60.0  # 0 turns the janitor off
    prune_batch_size: Annotated[int, Field(gt=0, le=1_000_000)] = (
        5000  # rows per delete, each its own short transaction
    )

    # Bounded waits on every pipeline connection (the relay's, the workers', the tools'):
    # no process waits without end on a lock, a statement, or a peer that stopped.
    # Milliseconds; 0 turns one off. Producers' sessions are the application's own.
    lock_timeout_ms: Count = 5_000  # a wait on a row or advisory lock
    statement_timeout_ms: Count = 60_000  # one statement's run time
    # A session idle inside its transaction this long is ended by the server (its locks go)
    idle_in_transaction_timeout_ms: Count = 120_000
    # TCP keepalives, both ends: a dead or partitioned peer is noticed within about
    # idle + 3 x (idle / 2) seconds and its backend (or connection) dropped. 0: OS defaults
    tcp_keepalives_idle_seconds: Annotated[int, Field(ge=0, le=32767)] = 10

    # Routing: a relay or publishing worker refuses to start while events wait whose type no
    # registered consumer takes (they would be sent to nobody), unless this says it is meant
    allow_unrouted: bool = False

    # Backpressure: unsent events (pending or publishing); 0 turns a threshold off
    backlog_warn: Count = 10_000  # the relay's gauge and warning
    backlog_limit: Count = 0  # add_event* raise BacklogFull above it

    # Message authentication (pipeline/signing.py): the relay signs, workers verify.
    # "insecure" (or "none") turns it off explicitly; unset, it is off with a warning.
    message_key: SecretStr | None = None
    message_key_previous: SecretStr | None = None  # still accepted while keys rotate

    @field_validator("schema_name", "redis_namespace")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not _IDENTIFIER.fullmatch(value):
            raise ValueError("use 1-63 characters of a-z, 0-9 and _, not starting with a digit")
        return value

    @field_validator("app_modules")
    @classmethod
    def _module_names(cls, value: str) -> str:
        for name in (part.strip() for part in value.split(",")):
            if name and not _MODULE.match(name):
                raise ValueError(
                    f"{name!r} is not a module name: expected comma-separated dotted Python "
                    "module names, e.g. myapp.consumers"
                )
        return value

    @field_validator("unordered_event_types", mode="before")
    @classmethod
    def _event_type_list(cls, value: Any) -> Any:
        """Comma-separated (``a.b,c.d``) or a JSON list (``["a.b"]``); each a valid event type."""
        expected = (
            "expected comma-separated event types or a JSON list of event types, "
            "e.g. order.placed,order.paid"
        )
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = json.loads(text)
                except ValueError:
                    raise ValueError(f"not valid JSON: {expected}") from None
            else:
                value = [part.strip() for part in text.split(",") if part.strip()]
        if not isinstance(value, list | tuple | set | frozenset) or not all(
            isinstance(item, str) and EVENT_TYPE.match(item) for item in value
        ):
            raise ValueError(expected)
        return frozenset(value)

    @field_validator("log_format", "log_level", mode="before")
    @classmethod
    def _any_case(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str):
            return value.strip().upper() if info.field_name == "log_level" else value.lower()
        return value

    @field_validator("metrics_host")
    @classmethod
    def _bind_address(cls, value: str) -> str:
        if not _HOST.match(value):
            raise ValueError("expected a host name or IP address to bind, e.g. 127.0.0.1")
        return value

    @field_validator("metrics_multiproc_dir")
    @classmethod
    def _directory(cls, value: str | None) -> str | None:
        if not value:
            return None
        if os.path.exists(value) and not os.path.isdir(value):
            raise ValueError("expected a directory (created if missing); this path is a file")
        return value

    @field_validator("trace_ui_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError(
                "expected an http:// or https:// URL, optionally with {trace_id}, "
                "e.g. http://localhost:16686/trace/{trace_id}"
            )
        return value or None

    @model_validator(mode="after")
    def _ranges(self) -> Self:
        for low, high in BOUNDS:
            if getattr(self, low) > getattr(self, high):
                raise ValueError(
                    f"{ENV_PREFIX}{low.upper()} ({getattr(self, low)}) must not exceed "
                    f"{ENV_PREFIX}{high.upper()} ({getattr(self, high)})"
                )
        return self

    @field_validator("database_url")
    @classmethod
    def _postgres_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return value
        url = value.get_secret_value()
        if not url.startswith(("postgresql://", "postgres://", "postgresql+psycopg://")):
            raise ValueError("must start with postgresql://")
        check_postgres_url(libpq_url(url))
        return value

    @model_validator(mode="after")
    def _broker_url_alias(self) -> Self:
        """PIPELINE_REDIS_URL and PIPELINE_BROKER_URL name one setting: either fills both."""
        broker, old = self.broker_url, self.redis_url
        if broker is None and old is not None:
            object.__setattr__(self, "broker_url", old)  # frozen: set once, while validating
        elif old is None and broker is not None:
            object.__setattr__(self, "redis_url", broker)
        elif broker is not None and old is not None and _secret(broker) != _secret(old):
            raise ValueError(
                f"{ENV_PREFIX}BROKER_URL and {ENV_PREFIX}REDIS_URL differ: set only "
                f"{ENV_PREFIX}BROKER_URL ({ENV_PREFIX}REDIS_URL is its older name)"
            )
        return self

    @field_validator("redis_url", "broker_url")
    @classmethod
    def _broker_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            url = value.get_secret_value()
            if not url.startswith(BROKER_URL_PREFIXES):
                raise ValueError(
                    "must start with redis://, rediss://, unix://, redis+sentinel://, amqp:// "
                    "or amqps://"
                )
            if url.startswith(("redis://", "rediss://", "unix://")):  # the others: transports
                check_redis_url(url)
        return value

    @field_validator("broker_management_url")
    @classmethod
    def _management_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value

    @field_validator("message_key", "message_key_previous")
    @classmethod
    def _message_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        key = value.get_secret_value()
        if key.strip().lower() in MESSAGE_KEY_OFF:
            return SecretStr(key.strip().lower())
        if len(key) < MESSAGE_KEY_MIN_CHARS:
            raise ValueError(
                f"a message key needs at least {MESSAGE_KEY_MIN_CHARS} characters "
                "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'), "
                "or 'insecure' to turn message authentication off"
            )
        return value

    @model_validator(mode="after")
    def _key_rotation(self) -> Self:
        if self.message_key_previous is not None and self.message_key is None:
            raise ValueError(
                f"{ENV_PREFIX}MESSAGE_KEY_PREVIOUS is set without {ENV_PREFIX}MESSAGE_KEY: "
                "set the new key in PIPELINE_MESSAGE_KEY and the old one in "
                "PIPELINE_MESSAGE_KEY_PREVIOUS"
            )
        return self

    def replace(self, **changes: object) -> Settings:
        """A validated copy with ``changes`` applied (``model_copy`` would skip validation)."""
        values = {name: getattr(self, name) for name in type(self).model_fields}
        values.update(changes)
        for name, alias in (("broker_url", "redis_url"), ("redis_url", "broker_url")):
            if name in changes and alias not in changes:  # one setting under two names
                values[alias] = changes[name]
        return load_settings(**values)

    def app_module_names(self) -> list[str]:
        return [name.strip() for name in self.app_modules.split(",") if name.strip()]

    def require_database_url(self) -> str:
        """The libpq URL (``postgresql://``), or a clear error naming the variable."""
        if self.database_url is None:
            raise ConfigurationError(f"{ENV_PREFIX}DATABASE_URL is not set")
        return libpq_url(self.database_url.get_secret_value())

    def require_broker_url(self) -> str:
        """The broker URL (``PIPELINE_BROKER_URL``, or its older name ``PIPELINE_REDIS_URL``)."""
        if self.broker_url is None:
            raise ConfigurationError(
                f"{ENV_PREFIX}BROKER_URL is not set (or its older name {ENV_PREFIX}REDIS_URL)"
            )
        return self.broker_url.get_secret_value()

    def require_redis_url(self) -> str:
        """The broker URL, by its older name (kept for callers written before RabbitMQ)."""
        return self.require_broker_url()

    @property
    def broker_is_amqp(self) -> bool:
        """True when the broker URL names RabbitMQ (``amqp://`` or ``amqps://``)."""
        return self.broker_url is not None and self.broker_url.get_secret_value().startswith(
            AMQP_URL_PREFIXES
        )

    @property
    def transport_name(self) -> str:
        """The transport the broker URL selects, as metrics label it: ``redis`` or ``rabbitmq``."""
        return "rabbitmq" if self.broker_is_amqp else "redis"

    def sqlalchemy_url(self) -> str:
        """The database URL with the psycopg 3 dialect, for SQLAlchemy engines."""
        return "postgresql+psycopg://" + self.require_database_url().split("://", 1)[1]


def check_postgres_url(url: str) -> None:
    """Refuse a URL that libpq or SQLAlchemy cannot parse, in words that never quote it.

    The drivers' own messages repeat the whole URL, password included.
    """
    import psycopg

    try:
        parts = urlsplit(url)
    except ValueError as exc:  # an unbalanced [ ] around an IPv6 host
        raise ValueError(f"is not a valid URL ({redact_secrets(str(exc), url)})") from None
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise ValueError("is not a valid URL: its port is not a number from 0 to 65535") from None
    if parts.netloc.count("@") > 1:  # libpq would end the password at the first @
        raise ValueError("has an @ in its user name or password: write it percent-encoded, as %40")
    try:
        params = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        reason = redact_secrets(str(exc).splitlines()[0], url)
        raise ValueError(f"is not a valid Postgres URL ({reason})") from None
    ports = str(params.get("port") or "")
    if ports and not all(_is_port(port) for port in ports.split(",") if port):
        raise ValueError("is not a valid URL: its port is not a number from 0 to 65535")


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and int(text) <= 65535


def check_redis_url(url: str) -> None:
    """Refuse a Redis URL redis-py would reject late (a bad port) or read wrong (``/notadb``
    silently means database 0), in words that never quote it."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise ValueError(
            "is not a valid URL: its port is not a number from 0 to 65535, or a [ ] around "
            "an IPv6 address is unbalanced"
        ) from None
    databases = [value for name, value in parse_qsl(parts.query) if name == "db"]
    if parts.scheme != "unix" and parts.path not in ("", "/"):
        databases.append(unquote(parts.path[1:]))
    for database in databases:
        if not (database.isascii() and database.isdigit()):
            raise ValueError(
                "names a database that is not a number: expected redis://host:port/N with "
                "N a database number such as 0"
            )


def libpq_url(url: str) -> str:
    """Normalise SQLAlchemy-style URLs to the plain form libpq and psycopg accept."""
    scheme, rest = url.split("://", 1)
    if scheme in ("postgresql+psycopg", "postgres"):
        scheme = "postgresql"
    return f"{scheme}://{rest}"


def _secret(value: object) -> object:
    return value.get_secret_value() if isinstance(value, SecretStr) else value


# PIPELINE_* variables that are not settings: the test suite's (servers, soak switch,
# test-only hooks) and the demo's and drill's own (PIPELINE_DEMO_*, PIPELINE_DRILL_*).
OTHER_VARIABLES = frozenset({"PIPELINE_SOAK"})
OTHER_PREFIXES = ("PIPELINE_DEMO_", "PIPELINE_DRILL_", "PIPELINE_TEST_")


def setting_names() -> list[str]:
    """Every ``PIPELINE_*`` variable that is a setting."""
    return sorted(f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields)


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """Each ``PIPELINE_*`` variable of ``environ`` that nothing reads, with the closest
    setting's name (``None`` when none is close): a typo that would change nothing."""
    import difflib

    known = setting_names()
    suffixes = {name.removeprefix(ENV_PREFIX): name for name in known}
    found = []
    for name in sorted(os.environ if environ is None else environ):
        upper = name.upper()
        if (
            not upper.startswith(ENV_PREFIX)
            or upper in known
            or upper in OTHER_VARIABLES
            or upper.startswith(OTHER_PREFIXES)
        ):
            continue
        close = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX), suffixes, n=1, cutoff=0.6)
        found.append((name, suffixes[close[0]] if close else None))
    return found


def unknown_variables_warning(environ: Mapping[str, str] | None = None) -> str | None:
    """One line naming every unknown ``PIPELINE_*`` variable and its closest setting."""
    unknown = unknown_variables(environ)
    if not unknown:
        return None
    named = ", ".join(
        f"{name} (did you mean {close}?)" if close else name for name, close in unknown
    )
    which = "variable" if len(unknown) == 1 else "variables"
    return f"unknown {which} {named}: no setting has that name, so it changes nothing"


_PARSE_FAILURE = re.compile(r'field "(\w+)"')


def load_settings(**overrides: object) -> Settings:
    """Read settings from the environment; invalid values raise one clear error line."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        message = str(first["msg"]).removeprefix("Value error, ")
        if first["loc"]:  # a field's own check; cross-field checks name their variables
            message = f"{ENV_PREFIX}{str(first['loc'][0]).upper()}: {message}"
        more = f" ({len(errors) - 1} more invalid settings)" if len(errors) > 1 else ""
        raise ConfigurationError(message + more) from None
    except SettingsError as exc:  # a value the environment source could not even parse
        found = _PARSE_FAILURE.search(str(exc))
        name = f"{ENV_PREFIX}{found.group(1).upper()}" if found else "a PIPELINE_* variable"
        raise ConfigurationError(f"{name}: cannot parse the value") from None


@lru_cache(maxsize=1)
def _environment_settings() -> Settings:
    return load_settings()


_configured: Settings | None = None


def configure(settings: Settings | None) -> None:
    """Make ``settings`` the process-wide default (``None`` returns to the environment)."""
    global _configured  # noqa: PLW0603
    _configured = settings
    _environment_settings.cache_clear()


def get_settings() -> Settings:
    """The process-wide settings: those given to :func:`configure`, else the environment."""
    return _configured if _configured is not None else _environment_settings()
