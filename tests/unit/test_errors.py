"""One exception tree, and driver errors turned into it at one seam."""

from __future__ import annotations

import inspect

import psycopg
import pytest
import redis
import sqlalchemy.exc

import pipeline
from pipeline import errors
from pipeline.config import Settings
from pipeline.driver_errors import translate, wrap_driver_errors

SETTINGS = Settings(
    database_url="postgresql://app:s3cret@127.0.0.1:1/appdb",  # type: ignore[arg-type]
    redis_url="redis://:r3dispw@127.0.0.1:2/0",  # type: ignore[arg-type]
)
REFUSED = (
    'connection failed: connection to server at "127.0.0.1", port 1 failed: Connection refused\n'
    "\tIs the server running on that host and accepting TCP/IP connections?"
)


def test_every_error_is_a_pipeline_error_drawn_in_the_tree():
    classes = [
        value
        for value in vars(errors).values()
        if inspect.isclass(value) and issubclass(value, BaseException)
    ]
    assert len(classes) == 16
    tree = errors.__doc__ or ""
    for cls in classes:
        assert issubclass(cls, errors.PipelineError), cls
        assert f" {cls.__name__} " in tree, f"{cls.__name__} is not drawn in the docstring"


def test_public_names_and_the_modules_that_raise_them_share_the_classes():
    from pipeline.envelope import EnvelopeError
    from pipeline.tools.harness.embedded import BinaryNotFoundError, EmbeddedServerError
    from pipeline.transport.publisher import PermanentPublishError, PublisherUnavailable

    assert EnvelopeError is errors.EnvelopeError and issubclass(EnvelopeError, ValueError)
    assert PublisherUnavailable is errors.PublisherUnavailable
    assert issubclass(PublisherUnavailable, pipeline.ServiceUnavailableError)
    assert PermanentPublishError is errors.PermanentPublishError
    assert issubclass(BinaryNotFoundError, EmbeddedServerError)
    assert issubclass(EmbeddedServerError, RuntimeError)
    for name in pipeline.__all__:
        if name.endswith("Error"):
            assert getattr(pipeline, name) is getattr(errors, name)


def test_a_refused_postgres_connection_is_one_line_naming_the_server_without_its_password():
    error = translate(psycopg.OperationalError(REFUSED), SETTINGS, "connect to")
    assert isinstance(error, errors.ServiceUnavailableError)
    assert str(error) == (
        "cannot connect to Postgres at 127.0.0.1:1/appdb: "
        'connection to server at "127.0.0.1", port 1 failed: Connection refused'
    )


def test_sqlalchemy_wrapped_driver_errors_are_unwrapped():
    wrapped = sqlalchemy.exc.OperationalError(
        "SELECT 1", {}, psycopg.OperationalError("server closed the connection unexpectedly")
    )
    error = translate(wrapped, SETTINGS)
    assert isinstance(error, errors.ServiceUnavailableError)
    assert str(error) == (
        "cannot use Postgres at 127.0.0.1:1/appdb: server closed the connection unexpectedly"
    )


def test_a_missing_pipeline_table_says_to_upgrade_but_other_missing_tables_stay_bugs():
    missing = psycopg.errors.UndefinedTable('relation "pipeline.relay_state" does not exist')
    error = translate(missing, SETTINGS)
    assert isinstance(error, errors.MigrationError)
    assert (
        str(error) == "the pipeline schema 'pipeline' is not installed: run `pipeline db upgrade`"
    )
    other = psycopg.errors.UndefinedTable('relation "shop.orders" does not exist')
    assert translate(other, SETTINGS) is None
    assert translate(psycopg.errors.UniqueViolation("duplicate key"), SETTINGS) is None


def test_permission_denied_and_an_unparseable_url_are_one_line_too():
    denied = psycopg.errors.InsufficientPrivilege("permission denied for table outbox")
    error = translate(denied, SETTINGS)
    assert isinstance(error, errors.PermissionDeniedError)
    assert str(error) == (
        "permission denied for table outbox: the database role lacks a grant (see docs/security.md)"
    )
    unparseable = psycopg.ProgrammingError('invalid dsn: missing "=" after "s3cret"')
    error = translate(unparseable, SETTINGS, "connect to")
    assert isinstance(error, errors.ConfigurationError)
    assert "PIPELINE_DATABASE_URL: not a valid Postgres URL" in str(error)
    assert "s3cret" not in str(error)
    assert translate(unparseable, SETTINGS, "use") is None  # after connecting: a bug


def test_redis_errors_name_the_server_without_its_password():
    error = translate(redis.ConnectionError("Error 111 connecting"), SETTINGS)
    assert isinstance(error, errors.ServiceUnavailableError)
    assert str(error) == (
        "cannot use Redis at redis://:***@127.0.0.1:2/0: ConnectionError: Error 111 connecting"
    )
    assert "r3dispw" not in str(error)


def test_the_seam_raises_the_translation_and_lets_everything_else_through():
    with pytest.raises(errors.ServiceUnavailableError) as caught:
        with wrap_driver_errors(SETTINGS):
            raise redis.TimeoutError("Timeout reading from socket")
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    bug = KeyError("a bug")
    with pytest.raises(KeyError) as passed:
        with wrap_driver_errors(SETTINGS):
            raise bug
    assert passed.value is bug
    own = errors.NotFoundError("no such event")
    with pytest.raises(errors.NotFoundError) as kept:
        with wrap_driver_errors(SETTINGS):
            raise own
    assert kept.value is own

    @wrap_driver_errors(SETTINGS, "connect to")
    def connect() -> None:
        raise psycopg.OperationalError(REFUSED)

    with pytest.raises(errors.ServiceUnavailableError, match="cannot connect to Postgres"):
        connect()
