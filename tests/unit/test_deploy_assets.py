"""The production assets agree with the code and with each other.

Compose file, Kubernetes manifests, Prometheus and Grafana configuration are parsed; every image, port,
setting, config file, secret and metric they name is checked against what the services really read and
export; the manifests validate against the Kubernetes API schemas (strict: unknown fields fail).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from pydantic_settings import BaseSettings

import dispatcher.metrics
import gpu_workers.metrics
import ingress.metrics
import scaler.metrics
from dispatcher.settings import DispatcherSettings
from gpu_workers.settings import WorkerSettings
from infra.acls import Grant, acl_script, service_grants, team_grants
from ingress.settings import IngressSettings
from queue_schemas.batch import TEAM_NAME
from queue_schemas.config import SluiceConfig, load_config
from queue_schemas.names import Names
from queue_schemas.settings import BusSettings
from scaler.settings import ScalerSettings
from tests.tools import promtool

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "infra" / "deploy"
K8S_VERSION = "1.31.0"
SETTINGS: dict[str, type[BaseSettings]] = {
    "ingress": IngressSettings,
    "dispatcher": DispatcherSettings,
    "worker": WorkerSettings,
    "scaler": ScalerSettings,
    "topics": BusSettings,
    "--help": BusSettings,
}
SECRETS = {"sluice-secrets", "sluice-tls"}  # made by operators; docs/operations.md says how


def pools() -> SluiceConfig:
    return load_config(DEPLOY / "pools.toml")


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return data


def manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def settings_from(cls: type[BaseSettings], env: dict[str, str]) -> BaseSettings:
    """Build a service's settings from SLUICE_* values exactly as the process would; unknown names fail."""
    fields = {}
    for name, value in env.items():
        if name.startswith("VLLM_"):  # the engine's own settings
            continue
        assert name.startswith("SLUICE_"), name
        field = name.removeprefix("SLUICE_").lower()
        assert field in cls.model_fields, f"{name} is not a setting of {cls.__name__}"
        fields[field] = value
    return cls.model_validate(fields)


def interpolate(value: str) -> str:
    """Compose's ${VAR:?message} with a stand-in value, as `docker compose config` would with VAR set."""
    return re.sub(r"\$\{[A-Z_]+(:\?[^}]*)?\}", "stand-in", value)


# compose


def test_compose_services_settings_and_files_are_consistent() -> None:
    spec = compose()
    services: dict[str, Any] = spec["services"]
    for name, svc in services.items():
        assert svc.get("image"), f"{name} has no image"
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
        if "build" in svc:
            assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        for mount in svc.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
        for config in svc.get("configs", []):
            assert config["source"] in spec["configs"]
        environment = svc.get("environment", {})
        env = {k: interpolate(str(v)) for k, v in environment.items() if k.startswith("SLUICE_")}
        if svc["image"].startswith("ghcr.io/sluice-llm/"):
            settings = settings_from(SETTINGS[svc["command"][0]], env)
            assert isinstance(settings, BusSettings)
            (mount,) = [c for c in svc["configs"] if c["source"] == "pools"]
            assert settings.config == Path(mount["target"])
    for config in spec["configs"].values():
        assert (DEPLOY / config["file"]).is_file()


def test_every_compose_service_exports_traces_to_the_tracing_backend() -> None:
    services = compose()["services"]
    for name, svc in services.items():
        if not svc["image"].startswith("ghcr.io/sluice-llm/"):
            continue
        env = svc["environment"]
        endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"]
        host, port = endpoint.removeprefix("http://").split(":")
        assert host in services, f"{name} exports to {host}, not a compose service"
        assert (port, env["OTEL_EXPORTER_OTLP_PROTOCOL"]) == ("4318", "http/protobuf"), name
        assert 0 < float(env["OTEL_TRACES_SAMPLER_ARG"]) <= 1, name
        settings = settings_from(BusSettings, {"SLUICE_TRACE_TIMELINE": env["SLUICE_TRACE_TIMELINE"]})
        assert isinstance(settings, BusSettings), name


def test_compose_has_a_dispatcher_and_a_gpu_worker_per_pool() -> None:
    services = compose()["services"]
    for pool in pools().pools:
        assert services[f"dispatcher-{pool.name}"]["command"] == ["dispatcher", "--pool", pool.name]
        names = [f"worker-{pool.name}"] + ([f"worker-{pool.name}-prefill"] if pool.scaling.prefill else [])
        for name in names:
            worker = services[name]
            assert worker["command"] == ["worker", "--pool", pool.name]
            (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
            assert device["count"] == pool.tensor_parallel_size
            assert "gpu" in device["capabilities"]
            state_file = worker["environment"]["SLUICE_STATE_FILE"]
            assert state_file in " ".join(worker["healthcheck"]["test"])
            assert worker["shm_size"]
            assert worker["environment"].get("SLUICE_ROLE") == (
                "prefill" if name.endswith("-prefill") else None
            )


def test_prometheus_scrapes_every_compose_service_on_its_port() -> None:
    services = compose()["services"]
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = config["scrape_configs"]
    targets = {t for job in jobs for sc in job.get("static_configs", []) for t in sc["targets"]}
    # A service with several replicas is found by DNS (every replica's address), on its port.
    targets |= {
        f"{n}:{sd['port']}" for job in jobs for sd in job.get("dns_sd_configs", []) for n in sd["names"]
    }
    by_dns = {n for job in jobs for sd in job.get("dns_sd_configs", []) for n in sd["names"]}
    expected = set()
    for name, svc in services.items():
        env = svc.get("environment", {})
        http_port = env.get("SLUICE_PORT") if name in ("ingress", "scaler") else None
        port = env.get("SLUICE_METRICS_PORT") or http_port
        if port:
            expected.add(f"{name}:{port}")
        replicas = svc.get("deploy", {}).get("replicas", 1)
        if replicas > 1 or name.startswith("worker-"):  # workers are scaled with --scale
            assert name in by_dns, f"{name} runs several replicas: scrape each one"
    assert targets == expected


# Kubernetes


def containers() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for doc in manifests():
        if doc["kind"] in ("Deployment", "Job"):
            for c in doc["spec"]["template"]["spec"]["containers"]:
                yield doc, c


def test_manifests_validate_against_the_kubernetes_schemas() -> None:
    docs = manifests()
    assert {d["kind"] for d in docs} >= {
        "Namespace", "ConfigMap", "Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "Job",
    }  # fmt: skip
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_manifest_settings_configmaps_and_secrets_are_consistent() -> None:
    docs = manifests()
    config_maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    # The pool file in the ConfigMap is the one the compose file mounts.
    assert config_maps["sluice-pools"]["pools.toml"].strip() == (DEPLOY / "pools.toml").read_text().strip()
    operations = (ROOT / "docs" / "operations.md").read_text()
    for secret in SECRETS:
        assert secret in operations, f"docs/operations.md does not say how to create {secret}"
    for doc, c in containers():
        spec = doc["spec"]["template"]["spec"]
        env: dict[str, str] = {}
        for source in c.get("envFrom", []):
            env.update(config_maps[source["configMapRef"]["name"]])
        for var in c.get("env", []):
            ref = var.get("valueFrom", {})
            if "secretKeyRef" in ref:
                assert ref["secretKeyRef"]["name"] in SECRETS
            env[var["name"]] = var.get("value", "from-" + next(iter(ref), "value").lower())
        settings = settings_from(SETTINGS[c["args"][0]], env)
        assert isinstance(settings, BusSettings)
        assert settings.kafka_security_protocol == "SASL_SSL"
        assert settings.redis_url.startswith("rediss://")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for mount in c.get("volumeMounts", []):
            assert mount["name"] in volumes
            volume = volumes[mount["name"]]
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
            if "secret" in volume:
                assert volume["secret"]["secretName"] in SECRETS
        mounted = {m["mountPath"] for m in c.get("volumeMounts", [])}
        assert str(settings.config) in mounted
        assert str(settings.kafka_ssl_cafile).rsplit("/", 1)[0] in mounted
        annotations = doc["spec"]["template"].get("metadata", {}).get("annotations", {})
        if "prometheus.io/port" in annotations:
            ports = {p["containerPort"] for p in c["ports"]}
            assert int(annotations["prometheus.io/port"]) in ports


def test_services_select_their_deployments_ports() -> None:
    docs = manifests()
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    for svc in (d for d in docs if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        (target,) = [
            d for d in deployments if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        names = {p["name"] for c in target["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names


def test_gpu_workers_scaler_rbac_and_readiness_follow_the_pools() -> None:
    docs = manifests()
    scaler_env = dict(
        (v["name"], v.get("value")) for doc, c in containers() if c["args"][0] == "scaler" for v in c["env"]
    )
    workload = scaler_env["SLUICE_KUBERNETES_WORKLOAD"]
    assert scaler_env["SLUICE_BACKEND"] == "kubernetes"
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "sluice-scaler"]
    (scale_rule,) = [r for r in role["rules"] if "deployments/scale" in r["resources"]]
    workloads = {workload.format(pool=p.name) for p in pools().pools}
    workloads |= {workload.format(pool=p.name) + "-prefill" for p in pools().pools if p.scaling.prefill}
    assert set(scale_rule["resourceNames"]) == workloads
    assert set(scale_rule["verbs"]) == {"get", "patch"}
    assert all("deployments" not in r["resources"] for r in role["rules"]), "only the scale subresource"
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == "sluice-scaler"
    assert binding["subjects"][0]["name"] == "sluice-scaler"
    (scaler_deployment,) = [d for d, c in containers() if c["args"][0] == "scaler"]
    assert scaler_deployment["spec"]["template"]["spec"]["serviceAccountName"] == "sluice-scaler"
    for name, pool in [
        (w, p) for p in pools().pools for w in workloads if w.startswith(workload.format(pool=p.name))
    ]:
        (worker,) = [d for d in docs if d["metadata"]["name"] == name]
        spec = worker["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        assert c["args"] == ["worker", "--pool", pool.name]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == pool.tensor_parallel_size
        env = {v["name"]: v for v in c["env"]}
        assert env["SLUICE_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        state_file = env["SLUICE_STATE_FILE"]["value"]
        assert c["readinessProbe"]["exec"]["command"] == ["grep", "-qx", "ready", state_file]
        shm = {v["name"]: v for v in spec["volumes"]}["dshm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        drain = float(env["SLUICE_DRAIN_TIMEOUT_S"]["value"])
        assert spec["terminationGracePeriodSeconds"] > drain
        role = env.get("SLUICE_ROLE", {}).get("value")
        assert role == ("prefill" if name.endswith("-prefill") else None)
        if pool.vllm is not None and pool.vllm.kv_connector is not None:  # NIXL's side channel: the pod IP
            host = env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert host == "status.podIP"


def test_least_privilege_in_the_assets() -> None:
    """No pod writes for the scaler; GPU workers non-root on a read-only root filesystem; unauthenticated
    endpoints bound to the host only; both images drop root."""
    docs = manifests()
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "sluice-scaler"]
    core_rules = [r for r in role["rules"] if r["apiGroups"] == [""]]
    assert core_rules == [{"apiGroups": [""], "resources": ["pods/status"], "verbs": ["get"]}]
    for pool in pools().pools:
        workload = f"sluice-worker-{pool.name}"
        (worker,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == workload]
        spec = worker["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        (c,) = spec["containers"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        writable = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/tmp", "/run/sluice", "/home/sluice/.cache", "/models"} <= writable

    services = compose()["services"]
    for name in ("scaler", "prometheus", "grafana"):
        assert all(str(p).startswith("127.0.0.1:") for p in services[name]["ports"]), name
    for pool in pools().pools:
        worker = services[f"worker-{pool.name}"]
        assert worker["read_only"] is True
        assert not worker["user"].startswith("0")
        assert {"/tmp", "/run/sluice", "/home/sluice/.cache"} <= set(worker["tmpfs"])
    for dockerfile in ("Dockerfile", "worker.Dockerfile"):
        users = [
            line.split()[1]
            for line in (DEPLOY / dockerfile).read_text().splitlines()
            if line.startswith("USER ")
        ]
        assert users, dockerfile
        assert users[-1] not in ("0", "root"), dockerfile


def grant_covers(grant: Grant, name: str) -> bool:
    return name.startswith(grant.name) if grant.prefixed else name == grant.name


def test_no_teams_group_grant_covers_another_teams_or_the_services_groups() -> None:
    names = Names("sluice")
    teams = ["a", "ab", "a-b", "a_b", "a0", "acme", "dispatcher", "batchapi", "batch-collector"]
    internal = [names.dispatcher_group(pool) for pool in ("chat", "a", "sim")]
    internal.append(names.batch_api_collector_group())
    # A team's groups sit under its name and a separator no team name may hold.
    assert all(TEAM_NAME.match(team) for team in teams)
    assert not TEAM_NAME.match("a.b")
    for team in teams:
        assert names.batch_collector_groups(team).endswith(f"{team}."), team
        groups = [g for g in team_grants(names, team) if g.resource == "group"]
        assert groups, team
        own = names.batch_collector_group(team, "batch_0123")
        others = [names.batch_collector_group(o, "batch_0123") for o in teams if o != team]
        for grant in groups:
            assert grant_covers(grant, own), (team, grant)
            assert not [g for g in others + internal if grant_covers(grant, g)], (team, grant)


def test_broker_acls_are_shipped_and_only_the_ingress_writes_requests() -> None:
    names = Names("sluice")
    assert (DEPLOY / "kafka-acls.sh").read_text() == acl_script(names, []), "regenerate: sluice topics acls"
    grants = service_grants(names) + team_grants(names, "acme", ("acme.answers.",))
    requests = names.requests_topic("")
    writers = {g.principal for g in grants if "Write" in g.operations and requests.startswith(g.name)}
    assert writers == {"User:sluice-ingress"}
    # Only services write the answers of /v1/batches (a team writing there could answer another team's
    # lines) and the usage topic.
    for topic, services in (
        (names.batch_api_answers_topic(), {"User:sluice-dispatcher", "User:sluice-worker"}),
        (names.usage_topic(), {"User:sluice-ingress"}),
    ):
        writes = {g.principal for g in grants if "Write" in g.operations and topic.startswith(g.name)}
        assert writes == services, topic
    team = [g for g in grants if g.principal == "User:team-acme"]
    assert {g.name for g in team if "Write" in g.operations} == {names.batch_topic("")}
    assert {g.name for g in team if g.resource == "topic" and "Read" in g.operations} == {
        names.results_topic("acme"),
        "acme.answers.",
    }
    # Each service in the cluster authenticates as its own principal, one the ACLs name.
    principals = {g.principal for g in grants}
    for _, c in containers():
        env = {v["name"]: v for v in c.get("env", [])}
        user = env["SLUICE_KAFKA_SASL_USERNAME"]["value"]
        assert f"User:{user}" in principals, user
        assert env["SLUICE_KAFKA_SASL_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"].endswith(
            user.split("-")[-1]
        )


# Grafana


def exported_metric_names() -> set[str]:
    """Every series name the services' metric modules define (a histogram or counter exports several)."""
    names = set()
    for module in (ingress.metrics, scaler.metrics, dispatcher.metrics, gpu_workers.metrics):
        for metric in vars(module).values():
            if isinstance(metric, MetricWrapperBase):
                base = metric._name
                names |= {base, f"{base}_bucket", f"{base}_total", f"{base}_count", f"{base}_sum"}
    return names


def test_grafana_panels_query_metrics_the_services_export() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "sluice-dashboard.json").read_text())
    exported = exported_metric_names()
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queried |= set(re.findall(r"\b(sluice_[a-z_]+)\b", target["expr"]))
    missing = queried - exported
    assert not missing, f"the dashboard queries metrics nothing exports: {sorted(missing)}"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    topics = ("lag", "first token", "inter-token", "queue wait", "kv", "prefix", "replicas", "quota")
    for topic in (*topics, "per team", "preemptions"):
        assert topic in titles, f"no panel about {topic}"


def test_compose_file_follows_the_compose_specification() -> None:
    """Against the Compose specification's JSON schema (as vendored by check-jsonschema)."""
    schema = json.loads(
        files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
    )
    jsonschema.validate(compose(), schema)
    misspelt = {**compose(), "services": {"ingress": {"image": "x", "restart_policy": "always"}}}
    with pytest.raises(jsonschema.ValidationError, match="restart_policy"):  # it checks each service
        jsonschema.validate(misspelt, schema)


def test_prometheus_configuration_passes_promtool() -> None:
    checked = subprocess.run(
        [promtool(), "check", "config", "--syntax-only", str(DEPLOY / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout + checked.stderr


def test_grafana_datasource_points_at_the_prometheus_service() -> None:
    provisioning = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    (source,) = provisioning["datasources"]
    assert source["type"] == "prometheus"
    published = compose()["services"]["prometheus"]["ports"][0]  # HOST:PORT:CONTAINER_PORT
    assert source["url"] == f"http://prometheus:{published.rsplit(':', 1)[1]}"
