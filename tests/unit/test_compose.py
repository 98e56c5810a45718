"""docker-compose.yml and the Dockerfile, checked without Docker (none on the dev machines).

What can rot silently is checked statically: files the build needs, commands that must
exist in the CLI, settings that must exist, image pins, health checks and start order.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import yaml

from pipeline.config import ENV_PREFIX, Settings
from pipeline.tools.cli import cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
VERSION_TAG = re.compile(r"^v?\d+(\.\d+){1,2}([.-][A-Za-z0-9.]+)?$")


def argv(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def _unparsed(ctx: click.Context) -> list[str]:
    with warnings.catch_warnings():  # click 8.2 deprecates protected_args (merged in 9.0)
        warnings.simplefilter("ignore", DeprecationWarning)
        return [*ctx.protected_args, *ctx.args]


def check_pipeline_command(args: list[str]) -> None:
    """Parse ``args`` with the real click tree: unknown commands or options raise."""
    ctx = cli.make_context("pipeline", list(args))
    command: click.Command = cli
    rest = _unparsed(ctx)
    while isinstance(command, click.Group) and rest:
        name, sub, rest = command.resolve_command(ctx, rest)
        assert sub is not None, f"no command {name!r}"
        ctx = sub.make_context(name or "", list(rest), parent=ctx)
        command = sub
        rest = _unparsed(ctx)
    assert not isinstance(command, click.Group), f"{args} names a group, not a command"


def test_expected_services_are_there():
    expected = {"postgres", "redis", "jaeger", "migrate", "payment-api", "relay", "worker", "demo"}
    expected |= {"prometheus", "alertmanager", "grafana"}
    assert expected <= set(SERVICES)


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_images_are_pinned_to_a_version(name):
    service = SERVICES[name]
    if "build" in service:
        return  # built from this repository (its base image is pinned in the Dockerfile)
    image = service["image"]
    assert ":" in image and "@" not in image, f"{name}: {image} has no tag"
    tag = image.rsplit(":", 1)[1]
    assert tag != "latest" and VERSION_TAG.match(tag), f"{name}: {image} is not a version"


def test_dockerfile_base_image_is_pinned_and_its_sources_exist():
    dockerfile = (ROOT / "Dockerfile").read_text()
    [base] = re.findall(r"^FROM\s+(\S+)", dockerfile, re.MULTILINE)
    name, _, tag = base.partition(":")
    assert name == "python" and re.fullmatch(r"3\.11\.\d+-slim", tag), base
    for line in re.findall(r"^COPY\s+(.+)$", dockerfile, re.MULTILINE):
        *sources, _target = line.split()
        for source in sources:
            assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"
    assert "pip install ." in dockerfile


def test_build_contexts_and_dockerfiles_exist():
    built = [s for s in SERVICES.values() if "build" in s]
    assert built
    for service in built:
        build = service["build"]
        context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
        assert context.is_dir()
        dockerfile = (
            "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        )
        assert (context / dockerfile).is_file()


def test_dockerignore_keeps_what_the_build_copies():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignored = {line.strip().rstrip("/") for line in lines if not line.startswith("#")}
    for needed in ("pipeline", "pyproject.toml", "README.md"):
        assert needed not in ignored


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_pipeline_commands_exist(name):
    args = argv(SERVICES[name])
    if args[:1] == ["pipeline"]:
        check_pipeline_command(args[1:])
    elif args[:2] == ["python", "-m"]:
        module = args[2]
        assert importlib.util.find_spec(module) is not None, module
        if module == "pipeline.tools.harness.payment_api":
            from pipeline.tools.harness.payment_api import build_parser

            build_parser().parse_args(args[3:])


def test_the_checker_rejects_what_does_not_exist():
    with pytest.raises(click.UsageError):
        check_pipeline_command(["no-such-command"])
    with pytest.raises(click.UsageError):
        check_pipeline_command(["relay", "--no-such-option"])
    with pytest.raises((AssertionError, click.UsageError)):
        check_pipeline_command(["db"])


def test_one_shot_migration_runs_pipeline_db_upgrade():
    assert argv(SERVICES["migrate"]) == ["pipeline", "db", "upgrade"]
    assert SERVICES["migrate"].get("restart") == "no"


@pytest.mark.parametrize(
    "name",
    [
        "postgres",
        "redis",
        "payment-api",
        "relay",
        "worker",
        "prometheus",
        "grafana",
        "rabbitmq-1",
        "rabbitmq-2",
        "rabbitmq-3",
        "relay-rabbitmq",
        "worker-rabbitmq",
    ],
)
def test_health_checks(name):
    check = SERVICES[name].get("healthcheck")
    assert check and check.get("test"), f"{name} has no health check"
    assert check["test"][0] in ("CMD", "CMD-SHELL")


def test_start_order_waits_on_health_and_migration():
    for name, service in SERVICES.items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions"
        for target, rule in depends.items():
            assert target in SERVICES, f"{name} depends on unknown {target}"
            condition = rule["condition"]
            assert condition in {
                "service_started",
                "service_healthy",
                "service_completed_successfully",
            }
            if condition == "service_healthy":
                assert "healthcheck" in SERVICES[target], f"{target} has no health check"
    for name in ("relay", "worker"):
        depends = SERVICES[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully"
        assert depends["redis"]["condition"] == "service_healthy"
    assert SERVICES["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert SERVICES["demo"]["depends_on"]["worker"]["condition"] == "service_healthy"


def test_pipeline_settings_exist_and_traces_go_to_jaeger():
    fields = set(Settings.model_fields)
    for name, service in SERVICES.items():
        environment = service.get("environment", {})
        assert isinstance(environment, dict), name
        for key in environment:
            if key.startswith(ENV_PREFIX) and not key.startswith("PIPELINE_DEMO_"):
                assert key.removeprefix(ENV_PREFIX).lower() in fields, f"{name}: unknown {key}"
        if "build" in service and name not in ("payment-api", "alert-receiver"):
            assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
            assert environment["OTEL_TRACES_EXPORTER"] == "otlp"
    assert SERVICES["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"


def test_demo_service_uses_the_running_pipeline():
    args = argv(SERVICES["demo"])
    assert args[:3] == ["pipeline", "demo", "--external"]
    api = args[args.index("--api-url") + 1]
    assert api == SERVICES["worker"]["environment"]["PIPELINE_DEMO_API_URL"]
    assert api.startswith("http://payment-api:")


def test_published_ports_bind_to_loopback():
    for name, service in SERVICES.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on all interfaces"


# -- the ops kit: Prometheus, Alertmanager, Grafana ---------------------------------------------


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts (``./host:/container[:ro]``)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *_ = str(volume).split(":")
        if source.startswith("."):
            mounts[target] = ROOT / source
    return mounts


def test_ops_kit_services_are_there_and_healthy_before_their_users():
    assert {"prometheus", "alertmanager", "grafana"} <= set(SERVICES)
    assert SERVICES["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    for name in ("prometheus", "grafana"):
        assert SERVICES[name]["healthcheck"]["test"][0] == "CMD"


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_bind_mounted_files_exist(name):
    for target, source in bind_mounts(SERVICES[name]).items():
        assert source.exists(), f"{name} mounts missing {source} at {target}"


def prometheus_config() -> dict[str, Any]:
    mounts = bind_mounts(SERVICES["prometheus"])
    command = argv(SERVICES["prometheus"])
    [config_flag] = [a for a in command if a.startswith("--config.file=")]
    return yaml.safe_load(mounts[config_flag.split("=", 1)[1]].read_text())


def test_prometheus_scrapes_relay_and_workers_under_the_kits_job_names():
    from pipeline.tools.opskit import KitOptions

    kit = KitOptions()
    jobs = {c["job_name"]: scrape_targets(c) for c in prometheus_config()["scrape_configs"]}
    relay_port = SERVICES["relay"]["ports"][0].rsplit(":", 1)[1]
    worker_port = SERVICES["worker"]["ports"][0].rsplit(":", 1)[1]
    assert jobs == {
        kit.relay_job: [f"relay:{relay_port}", f"relay-rabbitmq:{relay_port}"],
        kit.worker_job: [f"worker:{worker_port}", f"worker-rabbitmq:{worker_port}"],
    }
    assert SERVICES["relay"]["environment"]["PIPELINE_METRICS_HOST"] == "0.0.0.0"


def scrape_targets(job: dict[str, Any]) -> list[str]:
    """host:port of a scrape job's static targets, then of its DNS-discovered names."""
    targets = [t for config in job.get("static_configs", []) for t in config["targets"]]
    for config in job.get("dns_sd_configs", []):
        assert config["type"] == "A"
        targets += [f"{name}:{config['port']}" for name in config["names"]]
    return targets


def test_prometheus_loads_the_committed_rules_and_alerts_alertmanager():
    config = prometheus_config()
    mounts = bind_mounts(SERVICES["prometheus"])
    [pattern] = config["rule_files"]
    directory, glob = pattern.rsplit("/", 1)
    assert mounts[directory] == ROOT / "alerts"
    loaded = sorted(p.name for p in (ROOT / "alerts").glob(glob))
    assert loaded == ["pipeline-alerts.yaml", "pipeline-recording-rules.yaml"]
    [target] = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host == "alertmanager"
    assert SERVICES["alertmanager"]["ports"][0].endswith(f":{port}")


def test_prometheus_config_passes_promtool(tmp_path):
    """promtool check config, with the rule glob pointed at the repository's alerts/."""
    from tests.opskit_support import tool

    config = prometheus_config()
    config["rule_files"] = [str(ROOT / "alerts" / "*.yaml")]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [tool("promtool"), "check", "config", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 2 rule files found" in result.stdout


def test_alertmanager_routes_name_existing_receivers():
    mounts = bind_mounts(SERVICES["alertmanager"])
    config = yaml.safe_load(mounts["/etc/alertmanager/alertmanager.yml"].read_text())
    receivers = {r["name"] for r in config["receivers"]}
    routes = [config["route"], *config["route"].get("routes", [])]
    assert all(route["receiver"] in receivers for route in routes)
    assert any('"PipelineWatchdog"' in str(r.get("matchers")) for r in routes)


def test_grafana_provisions_the_datasource_and_the_dashboards():
    grafana = SERVICES["grafana"]
    mounts = bind_mounts(grafana)
    datasources = mounts["/etc/grafana/provisioning/datasources"]
    [datasource] = yaml.safe_load((datasources / "prometheus.yaml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    prometheus_port = SERVICES["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert datasource["url"] == f"http://prometheus:{prometheus_port}"
    providers = mounts["/etc/grafana/provisioning/dashboards"]
    [provider] = yaml.safe_load((providers / "pipeline.yaml").read_text())["providers"]
    assert mounts[provider["options"]["path"]] == ROOT / "dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    directory, name = home.rsplit("/", 1)
    assert directory == provider["options"]["path"]
    assert (ROOT / "dashboards" / name).is_file()


def alertmanager_config() -> dict[str, Any]:
    mounts = bind_mounts(SERVICES["alertmanager"])
    return dict(yaml.safe_load(mounts["/etc/alertmanager/alertmanager.yml"].read_text()))


def test_alertmanager_config_passes_amtool():
    from tests.opskit_support import tool

    mounts = bind_mounts(SERVICES["alertmanager"])
    result = subprocess.run(
        [tool("amtool"), "check-config", str(mounts["/etc/alertmanager/alertmanager.yml"])],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_inhibitions_are_by_severity_and_cause_and_never_cross_deployments():
    rules = alertmanager_config()["inhibit_rules"]
    assert any(
        'severity = "critical"' in r["source_matchers"][0]
        and "warning" in " ".join(r["target_matchers"])
        for r in rules
    )
    for rule in rules:
        assert rule.get("equal"), rule  # without equal, one deployment mutes every other


def test_receivers_post_to_the_example_webhook_service():
    config = alertmanager_config()
    for receiver in config["receivers"]:
        [webhook] = receiver["webhook_configs"]
        url = webhook["url"]
        host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
        assert host in SERVICES, url
        assert f"--port {port}" in " ".join(argv(SERVICES[host])), url
    assert SERVICES["alertmanager"]["depends_on"]["alert-receiver"]


def test_the_runbooks_service_serves_the_rendered_pages_at_the_kits_base_url():
    from pipeline.tools.opskit import KitOptions

    runbooks = SERVICES["runbooks"]
    mounts = bind_mounts(runbooks)
    assert ROOT / "runbooks" in mounts.values()
    [published] = runbooks["ports"]
    base = KitOptions().runbook("README").removesuffix("/README.md")
    assert base == f"http://localhost:{published.rsplit(':', 1)[1]}"
    conf = mounts["/etc/nginx/conf.d/default.conf"].read_text()
    assert f"listen {published.rsplit(':', 1)[1]};" in conf
    root = re.search(r"root (\S+);", conf)
    assert root and mounts[root.group(1)] == ROOT / "runbooks"


# -- the rabbitmq profile: a three-node RabbitMQ cluster and a pipeline on it ----------------

RABBITMQ_NODES = ("rabbitmq-1", "rabbitmq-2", "rabbitmq-3")
RABBITMQ_PIPELINE = ("migrate-rabbitmq", "relay-rabbitmq", "worker-rabbitmq", "demo-rabbitmq")


def profile_services(profile: str) -> set[str]:
    return {name for name, s in SERVICES.items() if profile in s.get("profiles", [])}


def rabbitmq_config() -> dict[str, str]:
    """compose/rabbitmq/rabbitmq.conf as the nodes mount it (key = value lines)."""
    [path] = {
        source
        for node in RABBITMQ_NODES
        for target, source in bind_mounts(SERVICES[node]).items()
        if target.startswith("/etc/rabbitmq/conf.d/")
    }
    lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    return dict(tuple(part.strip() for part in line.split("=", 1)) for line in lines if line)


def test_the_rabbitmq_profile_adds_a_cluster_and_a_pipeline_and_nothing_else():
    assert profile_services("rabbitmq") == {*RABBITMQ_NODES, *RABBITMQ_PIPELINE}
    for name, service in SERVICES.items():
        assert set(service.get("profiles", [])) <= {"rabbitmq"}, name
        if not service.get("profiles"):  # compose refuses a default service needing a profile
            assert not set(service.get("depends_on", {})) & profile_services("rabbitmq"), name


def test_the_rabbitmq_nodes_form_one_cluster():
    config = rabbitmq_config()
    assert config["cluster_formation.peer_discovery_backend"] == "classic_config"
    listed = {v for k, v in config.items() if k.startswith("cluster_formation.classic_config")}
    assert listed == {f"rabbit@{SERVICES[node]['hostname']}" for node in RABBITMQ_NODES}
    assert {SERVICES[node]["hostname"] for node in RABBITMQ_NODES} == set(RABBITMQ_NODES)
    cookies = {SERVICES[node]["environment"]["RABBITMQ_ERLANG_COOKIE"] for node in RABBITMQ_NODES}
    assert len(cookies) == 1  # one Erlang cookie, or the nodes cannot talk
    for node in RABBITMQ_NODES:
        assert SERVICES[node]["image"].startswith("rabbitmq:")
        assert "rabbitmq-diagnostics" in " ".join(SERVICES[node]["healthcheck"]["test"])
        volumes = [str(v) for v in SERVICES[node]["volumes"]]
        assert any(v.endswith(":/var/lib/rabbitmq") for v in volumes), node  # its own data
    for node in RABBITMQ_NODES[1:]:  # the first node forms the cluster, the others join
        assert SERVICES[node]["depends_on"]["rabbitmq-1"]["condition"] == "service_healthy"


def test_the_rabbitmq_pipeline_uses_every_node_with_quorum_queues_in_its_own_schema():
    from pipeline.transport.amqp.broker import queue_arguments

    config = rabbitmq_config()
    environments = [SERVICES[name]["environment"] for name in RABBITMQ_PIPELINE]
    assert all(env == environments[0] for env in environments[:3])  # migrate, relay, worker
    env = environments[0]
    settings = Settings(
        broker_url=env["PIPELINE_BROKER_URL"],  # type: ignore[arg-type]
        schema_name=env["PIPELINE_SCHEMA_NAME"],
    )
    assert settings.broker_is_amqp and settings.transport_name == "rabbitmq"
    urls = [urlsplit(url) for url in env["PIPELINE_BROKER_URL"].split(";")]
    assert [(u.hostname, u.port) for u in urls] == [(node, 5672) for node in RABBITMQ_NODES]
    assert {(u.username, u.password) for u in urls} == {
        (config["default_user"], config["default_pass"])
    }
    assert env["PIPELINE_BROKER_CONSUMER_TIMEOUT_MS"] == config["consumer_timeout"]
    assert queue_arguments(settings.redis_namespace, "orders")["x-queue-type"] == "quorum"
    redis_env = SERVICES["relay"]["environment"]
    assert urlsplit(redis_env["PIPELINE_BROKER_URL"]).scheme == "redis"
    assert env["PIPELINE_SCHEMA_NAME"] != redis_env.get("PIPELINE_SCHEMA_NAME", "pipeline")
    assert env["PIPELINE_DEMO_SCHEMA"] != redis_env["PIPELINE_DEMO_SCHEMA"]
    assert env["PIPELINE_DATABASE_URL"] == redis_env["PIPELINE_DATABASE_URL"]
    for name in ("relay-rabbitmq", "worker-rabbitmq"):
        depends = SERVICES[name]["depends_on"]
        assert depends["migrate-rabbitmq"]["condition"] == "service_completed_successfully"
        for node in RABBITMQ_NODES:
            assert depends[node]["condition"] == "service_healthy", (name, node)
        assert argv(SERVICES[name])[:2] == argv(SERVICES[name.removesuffix("-rabbitmq")])[:2]
    assert argv(SERVICES["migrate-rabbitmq"]) == ["pipeline", "db", "upgrade"]


def test_the_rabbitmq_demo_checks_its_own_workers():
    args = argv(SERVICES["demo-rabbitmq"])
    assert args[:3] == ["pipeline", "demo", "--external"]
    metrics_url = urlsplit(args[args.index("--worker-metrics-url") + 1])
    worker_port = SERVICES["worker-rabbitmq"]["ports"][0].rsplit(":", 1)[1]
    assert (metrics_url.hostname, str(metrics_url.port)) == ("worker-rabbitmq", worker_port)
    assert SERVICES["demo-rabbitmq"]["depends_on"]["worker-rabbitmq"]["condition"] == (
        "service_healthy"
    )
