"""deploy/k8s/, checked offline (no cluster, no network): every document parses; the core kinds
validate, strictly (an unknown field is an error), against the schemas of Kubernetes
KUBERNETES_VERSION that the kubernetes-validate package ships; the KEDA ScaledObject against
deploy/k8s/schema/, written from KEDA's documented fields.

Then what no schema knows, each check a function that returns its problems, run on the manifests
(none) and on a copy broken on purpose (at least one): every variable is one outbox reads, with a
value it accepts; every command is one the CLI parses; the probes ask the endpoints on the port
OUTBOX_METRICS_PORT opens; the worker's SIGTERM wait covers the longest lease of its handler
module (computed from the module); every disruption budget selects a Deployment; every container
runs as a non-root user on a read-only root; the ScaledObject scales the worker on series the code
exports; the Secrets hold placeholders only."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from outbox import cli, settings
from outbox.alerts import ALERT_HOOK_ENV
from outbox.cli import dashboard as dashboard_cli
from outbox.cli.flags import LOG_LEVEL_ENV
from outbox.dashboard.security import MIN_SECRET_CHARS, parse_users
from outbox.logs import LOG_FORMAT_ENV, LOG_FORMATS

from .test_deploy import RULES, exported, queried

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCALEDOBJECT_SCHEMA = K8S / "schema" / "scaledobject-keda-v1alpha1.json"
#: The Kubernetes release whose schemas the core kinds are validated against (the package ships
#: 1.25 to 1.37): old enough for most clusters, new enough for every field used here
#: (PodDisruptionBudget's unhealthyPodEvictionPolicy is on by default from 1.27).
KUBERNETES_VERSION = "1.30"
#: What each component runs: `outbox SUBCOMMAND`.
SUBCOMMANDS = {
    "migrate": "migrate",
    "relay": "relay",
    "worker": "worker",
    "reconciler": "reconcile",
    "dashboard": "dashboard",
}
#: The processes that serve /healthz, /readyz and /metrics on OUTBOX_METRICS_PORT.
PROBED = ("relay", "worker", "reconciler")
#: What the worker needs past its longest lease to stop: its pools, heartbeat and Redis
#: connections closed (worker.yaml gives 20 s).
WORKER_STOP_MARGIN_SECONDS = 10.0
#: The reconciler stops between rows: one lookup in hand, bounded by its time_limit.
RECONCILER_STOP_MARGIN_SECONDS = 10.0
#: From zero workers to a live heartbeat, beside KEDA's pollingInterval and the reading's
#: OUTBOX_RECONCILE_INTERVAL: a Prometheus scrape (up to 30 s) and a pod's start (up to 60 s).
WAKE_FROM_ZERO_SECONDS = 90.0
PLACEHOLDER = "REPLACE-ME"

Doc = dict[str, Any]


# -- the manifests -------------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted(K8S.glob("*.yaml"))


def load() -> list[Doc]:
    docs = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                doc.setdefault("metadata", {})
                docs.append(doc)
    return docs


@pytest.fixture()
def docs() -> list[Doc]:
    return load()


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def component(doc: Doc) -> str:
    return str(doc["metadata"]["labels"]["app.kubernetes.io/component"])


def workloads(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in ("Deployment", "Job")]


def workload(docs: list[Doc], name: str) -> Doc:
    found = [d for d in workloads(docs) if component(d) == name]
    assert len(found) == 1, f"component {name}: {len(found)} workloads"
    return found[0]


def pod(doc: Doc) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def container(doc: Doc) -> dict[str, Any]:
    containers = pod(doc)["containers"]
    assert len(containers) == 1, doc["metadata"]["name"]
    return containers[0]


def secret_values(secret: Doc) -> dict[str, str]:
    return {k: str(v) for k, v in (secret.get("stringData") or {}).items()}


def environment(docs: list[Doc], spec: dict[str, Any]) -> dict[str, str]:
    """The variables a container gets: its envFrom sources whole, then its env entries."""
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        if "configMapRef" in source:
            data = named(docs, "ConfigMap", source["configMapRef"]["name"]).get("data") or {}
            env.update({k: str(v) for k, v in data.items()})
        if "secretRef" in source:
            env.update(secret_values(named(docs, "Secret", source["secretRef"]["name"])))
    for item in spec.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secret_values(named(docs, "Secret", ref["name"]))[ref["key"]]
        elif "configMapKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = str(named(docs, "ConfigMap", ref["name"])["data"][ref["key"]])
    return env


def known_variables() -> set[str]:
    return {
        *settings.ENVIRONMENT,
        ALERT_HOOK_ENV,
        LOG_LEVEL_ENV,
        LOG_FORMAT_ENV,
        dashboard_cli.SECRET_ENV,
        dashboard_cli.USERS_ENV,
        dashboard_cli.INSECURE_ENV,
        dashboard_cli.TRUSTED_PROXIES_ENV,
    }


def command(doc: Doc) -> list[str]:
    return [str(c) for c in container(doc)["command"]]


def parsed(argv: list[str]) -> Any:
    """`outbox …` as the CLI parses it; SystemExit (argparse's refusal) when it does not."""
    return cli.build_parser().parse_args(argv[1:])


def port_number(spec: dict[str, Any], port: int | str) -> int:
    """A probe's or a Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for p in spec.get("ports", []) if p.get("name") == port]
    return numbers[0] if numbers else -1


# -- the schemas -----------------------------------------------------------------------------------


def test_every_manifest_parses_and_names_its_kind() -> None:
    assert {p.name for p in manifest_files()} >= {
        "config.yaml",
        "migrate-job.yaml",
        "relay.yaml",
        "worker.yaml",
        "worker-scaledobject.yaml",
        "reconciler.yaml",
        "dashboard.yaml",
    }
    for doc in load():
        assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"].get("name"), doc


def core_documents() -> list[Doc]:
    return [d for d in load() if d["kind"] != "ScaledObject"]


@pytest.mark.parametrize(
    "doc", core_documents(), ids=[f"{d['kind']}/{d['metadata']['name']}" for d in core_documents()]
)
def test_core_kinds_validate_against_the_kubernetes_schemas(doc: Doc) -> None:
    # It answers with the release whose schemas it used: this one, not an older fallback.
    assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_the_validation_refuses_an_unknown_field_and_a_wrong_type(docs: list[Doc]) -> None:
    misspelled = copy.deepcopy(workload(docs, "worker"))
    pod(misspelled)["terminationGracePeriodSecond"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelled, KUBERNETES_VERSION, strict=True)
    wrong_type = copy.deepcopy(named(docs, "PodDisruptionBudget", "outbox-relay"))
    wrong_type["spec"]["selector"]["matchLabels"] = ["app.kubernetes.io/component=relay"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, KUBERNETES_VERSION, strict=True)


def test_the_kubernetes_schemas_come_from_the_package_not_the_network(
    docs: list[Doc], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("kubernetes-validate tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    for doc in docs:
        if doc["kind"] != "ScaledObject":
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def scaledobject_validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCALEDOBJECT_SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_the_scaledobject_validates_against_the_keda_schema(docs: list[Doc]) -> None:
    scaled = of_kind(docs, "ScaledObject")
    assert scaled, "no ScaledObject"
    validator = scaledobject_validator()
    for doc in scaled:
        errors = [e.message for e in validator.iter_errors(doc)]
        assert not errors, errors


def _mutated_scaledobject(change: Callable[[Doc], None]) -> Doc:
    doc = copy.deepcopy(of_kind(load(), "ScaledObject")[0])
    change(doc)
    return doc


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda d: d["spec"].update(pollingInterwal=15), id="a misspelled field"),
        pytest.param(lambda d: d["spec"]["scaleTargetRef"].pop("name"), id="no target"),
        pytest.param(
            lambda d: d["spec"]["triggers"][0]["metadata"].update(threshold=16), id="a number in metadata"
        ),
        pytest.param(
            lambda d: d["spec"]["triggers"][0]["metadata"].pop("query"), id="a trigger without its query"
        ),
        pytest.param(
            lambda d: d["spec"]["triggers"][0]["metadata"].update(treshold="16"), id="an unknown key"
        ),
        pytest.param(lambda d: d["spec"]["triggers"][0].update(metricType="Value"), id="fallback with Value"),
        pytest.param(lambda d: d["spec"]["fallback"].pop("replicas"), id="fallback without replicas"),
    ],
)
def test_the_keda_schema_refuses(change: Callable[[Doc], None]) -> None:
    assert list(scaledobject_validator().iter_errors(_mutated_scaledobject(change)))


# -- what no schema knows: each check returns its problems -------------------------------------------


def variables_problems(docs: list[Doc]) -> list[str]:
    """ConfigMaps and Secrets hold OUTBOX_* variables only (the dashboard's users file aside, which
    is mounted), each one outbox reads; every container's environment is one the settings accept."""
    problems = []
    known = known_variables()
    for doc in [*of_kind(docs, "ConfigMap"), *of_kind(docs, "Secret")]:
        keys = set(doc.get("data") or {}) | set(doc.get("stringData") or {})
        mounted = {
            item["key"]
            for w in workloads(docs)
            for v in pod(w).get("volumes", [])
            if v.get("secret", {}).get("secretName") == doc["metadata"]["name"]
            for item in v["secret"].get("items", [])
        }
        for key in sorted(keys - mounted - known):
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: {key} is not a variable outbox reads")
    for doc in workloads(docs):
        env = environment(docs, container(doc))
        for name in sorted(n for n in env if n.startswith("OUTBOX_") and n not in known):
            problems.append(f"{doc['metadata']['name']}: {name} is not a variable outbox reads")
        try:
            settings.from_env({k: v for k, v in env.items() if k in settings.ENVIRONMENT})
        except settings.ConfigError as exc:
            problems.append(f"{doc['metadata']['name']}: {exc}")
        if env.get(LOG_FORMAT_ENV, "text") not in LOG_FORMATS:
            problems.append(f"{doc['metadata']['name']}: {LOG_FORMAT_ENV}={env[LOG_FORMAT_ENV]}")
        for required in ("OUTBOX_DATABASE_URL",) + (
            ("OUTBOX_REDIS_URL",) if component(doc) in PROBED else ()
        ):
            if required not in env:
                problems.append(f"{doc['metadata']['name']}: no {required}")
    return problems


def commands_problems(docs: list[Doc]) -> list[str]:
    """Every container runs the outbox subcommand of its component, with arguments the CLI accepts
    and a handler module that can be imported."""
    problems = []
    for doc in workloads(docs):
        argv, name = command(doc), doc["metadata"]["name"]
        expected = SUBCOMMANDS.get(component(doc))
        if argv[:2] != ["outbox", expected]:
            problems.append(f"{name}: runs {shlex.join(argv)}, not `outbox {expected}`")
            continue
        try:
            args = parsed(argv)
        except SystemExit:
            problems.append(f"{name}: `{shlex.join(argv)}` is refused by the CLI")
            continue
        module = getattr(args, "module", None)
        if module is not None and not _importable(module):
            problems.append(f"{name}: handler module {module} cannot be imported")
    return problems


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def probes_problems(docs: list[Doc]) -> list[str]:
    """Relay, worker and reconciler: startup and liveness probes ask /healthz, readiness /readyz,
    all on the port OUTBOX_METRICS_PORT opens, and their Service scrapes that port. The dashboard:
    its probes ask /login on the port of its command."""
    problems = []
    for doc in workloads(docs):
        spec, name, part = container(doc), doc["metadata"]["name"], component(doc)
        if part in PROBED:
            env = environment(docs, spec)
            port = int(env.get("OUTBOX_METRICS_PORT", "-1"))
            paths = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
        elif part == "dashboard":
            port = parsed(command(doc)).port
            paths = {"startupProbe": "/login", "livenessProbe": "/login", "readinessProbe": "/login"}
        else:
            continue
        for probe, path in paths.items():
            get = spec.get(probe, {}).get("httpGet")
            if get is None:
                problems.append(f"{name}: no {probe} over HTTP")
                continue
            if get.get("path") != path:
                problems.append(f"{name}: {probe} asks {get.get('path')}, not {path}")
            if port_number(spec, get["port"]) != port:
                problems.append(f"{name}: {probe} asks port {get['port']}, the process listens on {port}")
        for service in of_kind(docs, "Service"):
            if service["spec"]["selector"] == doc["spec"]["selector"]["matchLabels"]:
                for entry in service["spec"]["ports"]:
                    if port_number(spec, entry.get("targetPort", entry["port"])) != port:
                        problems.append(f"Service/{service['metadata']['name']}: targets no port {port}")
    return problems


@cache
def handler_timings(module: str, env: tuple[tuple[str, str], ...]) -> dict[str, tuple[float, float]]:
    """destination -> (lease_seconds, time_limit) of MODULE's handlers as the container would
    declare them (its environment, which the module may read), in a process of their own: the
    handler registry of this one is the other tests'."""
    code = textwrap.dedent(
        """
        import json, sys
        from outbox.handlers import load_module
        found = load_module(sys.argv[1])
        print(json.dumps({d: [h.lease_seconds, h.time_limit] for d, h in found.items()}))
        """
    )
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "SHOP_"))}
    keep["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", code, module],
        env={**keep, **dict(env)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return {d: (float(v[0]), float(v[1])) for d, v in json.loads(proc.stdout).items()}


def _timings(docs: list[Doc], doc: Doc) -> dict[str, tuple[float, float]]:
    env = environment(docs, container(doc))
    relevant = tuple(sorted((k, v) for k, v in env.items() if not k.startswith("OUTBOX_")))
    return handler_timings(parsed(command(doc)).module, relevant)


def grace_problems(docs: list[Doc]) -> list[str]:
    """The kubelet's SIGKILL comes after terminationGracePeriodSeconds: the worker's must exceed
    the longest lease of its handlers (its SIGTERM wait) by its stop margin, the reconciler's the
    longest time_limit (one lookup in hand) by its own."""
    problems = []
    for part, index, margin in (
        ("worker", 0, WORKER_STOP_MARGIN_SECONDS),
        ("reconciler", 1, RECONCILER_STOP_MARGIN_SECONDS),
    ):
        doc = workload(docs, part)
        longest = max(t[index] for t in _timings(docs, doc).values())
        grace = pod(doc).get("terminationGracePeriodSeconds", 30)
        if grace < longest + margin:
            what = "lease" if index == 0 else "time_limit"
            problems.append(
                f"{doc['metadata']['name']}: terminationGracePeriodSeconds {grace} < the longest {what} "
                f"of its handlers ({longest:g} s) + {margin:g} s"
            )
    return problems


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    wanted = selector.get("matchLabels", {})
    return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())


def budgets_problems(docs: list[Doc]) -> list[str]:
    """Every PodDisruptionBudget selects the pods of exactly one Deployment, and leaves a
    voluntary eviction possible; relay, worker and reconciler each have one."""
    problems = []
    covered = set()
    deployments = of_kind(docs, "Deployment")
    for budget in of_kind(docs, "PodDisruptionBudget"):
        name = budget["metadata"]["name"]
        matched = [
            d
            for d in deployments
            if _selects(budget["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
        ]
        if len(matched) != 1:
            problems.append(f"PodDisruptionBudget/{name} selects {len(matched)} Deployments")
            continue
        target = matched[0]
        covered.add(component(target))
        replicas = target["spec"].get("replicas")
        least = budget["spec"].get("minAvailable")
        if isinstance(least, int) and (replicas is None or least >= replicas):
            problems.append(
                f"PodDisruptionBudget/{name}: minAvailable {least} of {replicas} replicas blocks every drain"
            )
        if budget["spec"].get("maxUnavailable") == 0:
            problems.append(f"PodDisruptionBudget/{name}: maxUnavailable 0 blocks every drain")
    for part in PROBED:
        if part not in covered:
            problems.append(f"the {part} has no PodDisruptionBudget")
    for deployment in deployments:
        if not _selects(deployment["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"]):
            problems.append(f"Deployment/{deployment['metadata']['name']}: its selector misses its pods")
    return problems


def image_uid() -> int:
    """The uid the Dockerfile gives its user."""
    found = re.search(r"useradd\b.*--uid (\d+)", (ROOT / "Dockerfile").read_text())
    assert found, "the Dockerfile creates no user with a fixed uid"
    return int(found.group(1))


def security_problems(docs: list[Doc]) -> list[str]:
    """Every pod runs as a non-root user by number (the image's USER is a name, which the kubelet
    cannot check), under RuntimeDefault seccomp, without a service account token or the Service
    variables; every container without privilege escalation or capabilities, on a read-only root
    with /tmp, the only place an outbox process writes, on an emptyDir."""
    problems = []
    for doc in workloads(docs):
        name, spec = doc["metadata"]["name"], pod(doc)
        context = spec.get("securityContext", {})
        if context.get("runAsNonRoot") is not True:
            problems.append(f"{name}: runAsNonRoot is not true")
        if not isinstance(context.get("runAsUser"), int) or context["runAsUser"] <= 0:
            problems.append(f"{name}: runAsUser {context.get('runAsUser')!r} is not a non-root uid")
        elif context["runAsUser"] != image_uid():
            # Another uid than the image's user still runs, owning none of the image's files.
            problems.append(
                f"{name}: runAsUser {context['runAsUser']} is not the Dockerfile's user ({image_uid()})"
            )
        if context.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            problems.append(f"{name}: no RuntimeDefault seccomp profile")
        if spec.get("automountServiceAccountToken") is not False:
            problems.append(f"{name}: mounts a service account token it never uses")
        if spec.get("enableServiceLinks") is not False:
            problems.append(f"{name}: the namespace's Services set OUTBOX_<SERVICE>_… variables in it")
        empty_dirs = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for c in spec["containers"]:
            own = c.get("securityContext", {})
            if own.get("runAsUser", context.get("runAsUser")) == 0 or own.get("runAsNonRoot") is False:
                problems.append(f"{name}/{c['name']}: runs as root")
            if own.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{name}/{c['name']}: allowPrivilegeEscalation is not false")
            if own.get("privileged"):
                problems.append(f"{name}/{c['name']}: privileged")
            if own.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{name}/{c['name']}: its root filesystem is writable")
            if "ALL" not in own.get("capabilities", {}).get("drop", []) or own.get("capabilities", {}).get(
                "add"
            ):
                problems.append(f"{name}/{c['name']}: capabilities are not all dropped")
            tmp = [
                m for m in c.get("volumeMounts", []) if m["mountPath"] == "/tmp" and m["name"] in empty_dirs
            ]
            if not tmp:
                problems.append(f"{name}/{c['name']}: no writable /tmp (an emptyDir) on its read-only root")
    return problems


def resources_problems(docs: list[Doc]) -> list[str]:
    problems = []
    for doc in workloads(docs):
        resources = container(doc).get("resources", {})
        for needed in (("requests", "cpu"), ("requests", "memory"), ("limits", "memory")):
            if needed[1] not in resources.get(needed[0], {}):
                problems.append(f"{doc['metadata']['name']}: no {'.'.join(needed)}")
    return problems


def images_problems(docs: list[Doc]) -> list[str]:
    """One image for every process, as in docker-compose.yml."""
    images = {container(d)["image"] for d in workloads(docs)}
    return [] if len(images) == 1 else [f"the processes run several images: {sorted(images)}"]


def _service_variables(name: str) -> set[str]:
    prefix = name.upper().replace("-", "_")
    return {f"{prefix}_SERVICE_HOST", f"{prefix}_SERVICE_PORT", f"{prefix}_PORT"}


def _rule(alert: str) -> dict[str, Any]:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    return next(r for r in rules if r.get("alert") == alert)


def services_problems(docs: list[Doc]) -> list[str]:
    """No Service is named so that the variables Kubernetes derives from its name (where service
    links are on) are outbox settings; relay, worker and reconciler are scraped under the job
    names deploy/prometheus/alerts.yml's OutboxProcessDown expects."""
    problems = []
    known = known_variables()
    for service in of_kind(docs, "Service"):
        name = service["metadata"]["name"]
        clash = _service_variables(name) & known
        if clash:
            problems.append(f"Service/{name}: Kubernetes would set {sorted(clash)}")
    down = _rule("OutboxProcessDown")["expr"]
    jobs = re.search(r'job=~"([^"]+)"', down)
    assert jobs, down
    for part in PROBED:
        doc = workload(docs, part)
        scraped = [
            s["metadata"]["name"]
            for s in of_kind(docs, "Service")
            if s["spec"]["selector"] == doc["spec"]["selector"]["matchLabels"]
        ]
        if not any(re.fullmatch(jobs.group(1), s) for s in scraped):
            problems.append(
                f"the {part}'s Service {scraped} is not a job OutboxProcessDown watches ({jobs.group(1)})"
            )
    return problems


def scaling_problems(docs: list[Doc]) -> list[str]:
    """The ScaledObject scales the worker Deployment (which leaves its replicas to it) on a query
    of series the code exports; at least one replica stays, unless the reconciler's no-consumer
    alert waits longer than a worker takes to come back from zero."""
    problems = []
    for scaled in of_kind(docs, "ScaledObject"):
        spec = scaled["spec"]
        target = [
            d for d in of_kind(docs, "Deployment") if d["metadata"]["name"] == spec["scaleTargetRef"]["name"]
        ]
        if len(target) != 1 or component(target[0]) != "worker":
            problems.append(
                f"ScaledObject/{scaled['metadata']['name']}: its target is not the worker Deployment"
            )
            continue
        if "replicas" in target[0]["spec"]:
            problems.append(
                f"{target[0]['metadata']['name']}: sets replicas, which every apply resets under KEDA"
            )
        for trigger in spec["triggers"]:
            if trigger["type"] != "prometheus":
                continue
            names = queried(trigger["metadata"]["query"])
            if not names or not names <= exported():
                problems.append(
                    f"the query asks series the code does not export: {sorted(names - exported())}"
                )
        lowest = spec.get("minReplicaCount", 0)
        queries = [t["metadata"]["query"] for t in spec["triggers"] if t["type"] == "prometheus"]
        if lowest < 1 and not any(counts_pending(q) for q in queries):
            problems.append(
                f"ScaledObject/{scaled['metadata']['name']}: scales to zero while rows wait out a "
                "backoff: the no-consumer alert counts pending rows, no trigger does"
            )
        if lowest < 1:
            env = environment(docs, container(workload(docs, "reconciler")))
            cfg = settings.from_env({k: v for k, v in env.items() if k in settings.ENVIRONMENT})
            wake = spec.get("pollingInterval", 30) + cfg.reconcile_interval_seconds + WAKE_FROM_ZERO_SECONDS
            for alert, after in (
                ("the reconciler's", cfg.no_consumer_cycles * cfg.reconcile_interval_seconds),
                (
                    "OutboxDestinationWithoutConsumer",
                    settings.parse_seconds(_rule("OutboxDestinationWithoutConsumer")["for"], "for"),
                ),
            ):
                if after <= wake:
                    problems.append(
                        f"ScaledObject/{scaled['metadata']['name']}: scales to zero, and {alert} no-consumer "
                        f"alert comes after {after:g} s, before a worker is back ({wake:g} s)"
                    )
        if spec.get("maxReplicaCount", 100) < max(1, lowest):
            problems.append("maxReplicaCount is below minReplicaCount")
    return problems


def counts_pending(query: str) -> bool:
    """Whether one of the query's ``outbox_rows`` selectors takes the pending rows."""
    for selector in re.findall(r"\boutbox_rows\b(\{[^}]*\})?", query):
        match = re.search(r'\bstate\s*(=~|!~|!=|=)\s*"([^"]*)"', selector)
        if match is None:
            return True
        op, value = match.groups()
        matched = re.fullmatch(value, "pending") is not None if "~" in op else value == "pending"
        if matched != op.startswith("!"):
            return True
    return False


def secrets_problems(docs: list[Doc]) -> list[str]:
    """The Secrets hold placeholders only, each of which keeps its process from starting: no
    password is committed, and none that works by accident reaches a cluster."""
    problems = []
    for secret in of_kind(docs, "Secret"):
        name = secret["metadata"]["name"]
        if secret.get("data"):
            problems.append(
                f"Secret/{name}: base64 data hides what is committed; use stringData placeholders"
            )
        for key, value in secret_values(secret).items():
            if PLACEHOLDER not in value:
                problems.append(f"Secret/{name}: {key} holds a value that is not a {PLACEHOLDER} placeholder")
            if key == dashboard_cli.SECRET_ENV and len(value) >= MIN_SECRET_CHARS:
                problems.append(f"Secret/{name}: the placeholder {key} is long enough to be used")
    dashboard = workload(docs, "dashboard")
    users_file = environment(docs, container(dashboard)).get(dashboard_cli.USERS_ENV, "")
    users = mounted_secret_file(docs, dashboard, users_file)
    if users is None:
        problems.append(f"the dashboard's {dashboard_cli.USERS_ENV} ({users_file!r}) is no file of a Secret")
    else:
        try:
            parse_users(users)
            problems.append("the dashboard's users file is not a placeholder: it parses")
        except settings.ConfigError:
            pass
    return problems


def mounted_secret_file(docs: list[Doc], doc: Doc, path: str) -> str | None:
    """What the file at ``path`` of the workload's container holds, when a Secret's key is mounted
    there."""
    mounts = {m["name"]: m["mountPath"] for m in container(doc).get("volumeMounts", [])}
    for volume in pod(doc).get("volumes", []):
        source = volume.get("secret")
        if source is None or volume["name"] not in mounts:
            continue
        for item in source.get("items", []):
            if f"{mounts[volume['name']]}/{item['path']}" == path:
                return secret_values(named(docs, "Secret", source["secretName"]))[item["key"]]
    return None


CHECKS: dict[str, Callable[[list[Doc]], list[str]]] = {
    "variables": variables_problems,
    "commands": commands_problems,
    "probes": probes_problems,
    "grace": grace_problems,
    "budgets": budgets_problems,
    "security": security_problems,
    "resources": resources_problems,
    "images": images_problems,
    "services": services_problems,
    "scaling": scaling_problems,
    "secrets": secrets_problems,
}


@pytest.mark.parametrize("check", CHECKS)
def test_the_manifests_pass(check: str, docs: list[Doc]) -> None:
    assert CHECKS[check](docs) == []


# -- each check refuses a broken copy --------------------------------------------------------------


def _config(docs: list[Doc]) -> dict[str, str]:
    return named(docs, "ConfigMap", "outbox-config")["data"]


def _env(docs: list[Doc], part: str, name: str, value: str) -> None:
    container(workload(docs, part)).setdefault("env", []).append({"name": name, "value": value})


def _probe(docs: list[Doc], part: str, probe: str) -> dict[str, Any]:
    return container(workload(docs, part))[probe]["httpGet"]


def _security(docs: list[Doc], part: str) -> dict[str, Any]:
    return container(workload(docs, part))["securityContext"]


def _scaled(docs: list[Doc]) -> dict[str, Any]:
    return of_kind(docs, "ScaledObject")[0]["spec"]


BREAKAGES: list[tuple[str, str, Callable[[list[Doc]], None]]] = [
    ("variables", "a misspelled variable", lambda d: _config(d).update(OUTBOX_METRIC_PORT="9400")),
    ("variables", "a value outbox refuses", lambda d: _config(d).update(OUTBOX_RETENTION="a week")),
    ("variables", "a non-outbox name in the map", lambda d: _config(d).update(SHOP_PROVIDER_URL="http://x")),
    ("variables", "an unknown log format", lambda d: _config(d).update(OUTBOX_LOG_FORMAT="logfmt")),
    (
        "variables",
        "no database",
        lambda d: named(d, "Secret", "outbox-secrets")["stringData"].pop("OUTBOX_DATABASE_URL"),
    ),
    (
        "commands",
        "a flag the CLI lacks",
        lambda d: container(workload(d, "worker"))["command"].append("--threds"),
    ),
    (
        "commands",
        "the wrong subcommand",
        lambda d: container(workload(d, "reconciler")).update(command=["outbox", "relay"]),
    ),
    (
        "commands",
        "a module that does not exist",
        lambda d: container(workload(d, "worker"))["command"].__setitem__(2, "examples.shop.handler"),
    ),
    ("probes", "another metrics port", lambda d: _config(d).update(OUTBOX_METRICS_PORT="9500")),
    (
        "probes",
        "readiness on /healthz",
        lambda d: _probe(d, "relay", "readinessProbe").update(path="/healthz"),
    ),
    ("probes", "liveness on /readyz", lambda d: _probe(d, "worker", "livenessProbe").update(path="/readyz")),
    ("probes", "an unnamed port", lambda d: _probe(d, "reconciler", "startupProbe").update(port="http")),
    ("probes", "no startup probe", lambda d: container(workload(d, "relay")).pop("startupProbe")),
    (
        "probes",
        "the dashboard on another port",
        lambda d: _probe(d, "dashboard", "livenessProbe").update(port=8080),
    ),
    (
        "grace",
        "less than the lease",
        lambda d: pod(workload(d, "worker")).update(terminationGracePeriodSeconds=30),
    ),
    ("grace", "the default wait", lambda d: pod(workload(d, "worker")).pop("terminationGracePeriodSeconds")),
    ("grace", "a longer time_limit", lambda d: _env(d, "worker", "SHOP_TIME_LIMIT", "20")),
    (
        "grace",
        "a reconciler cut short",
        lambda d: pod(workload(d, "reconciler")).update(terminationGracePeriodSeconds=15),
    ),
    (
        "budgets",
        "a selector that misses",
        lambda d: named(d, "PodDisruptionBudget", "outbox-relay")["spec"]["selector"]["matchLabels"].update(
            {"app.kubernetes.io/component": "relays"}
        ),
    ),
    (
        "budgets",
        "a budget blocking drains",
        lambda d: named(d, "PodDisruptionBudget", "outbox-relay")["spec"].update(minAvailable=2),
    ),
    (
        "budgets",
        "no budget for the worker",
        lambda d: d.remove(named(d, "PodDisruptionBudget", "outbox-worker")),
    ),
    ("security", "root", lambda d: pod(workload(d, "relay"))["securityContext"].update(runAsUser=0)),
    (
        "security",
        "another uid than the image's",
        lambda d: pod(workload(d, "worker"))["securityContext"].update(runAsUser=10002),
    ),
    (
        "security",
        "a user by name only",
        lambda d: pod(workload(d, "migrate"))["securityContext"].pop("runAsUser"),
    ),
    ("security", "a writable root", lambda d: _security(d, "worker").pop("readOnlyRootFilesystem")),
    ("security", "no /tmp", lambda d: container(workload(d, "worker"))["volumeMounts"].clear()),
    (
        "security",
        "privilege escalation",
        lambda d: _security(d, "dashboard").update(allowPrivilegeEscalation=True),
    ),
    (
        "security",
        "a capability kept",
        lambda d: _security(d, "reconciler")["capabilities"].update(add=["NET_RAW"]),
    ),
    ("security", "service links", lambda d: pod(workload(d, "relay")).pop("enableServiceLinks")),
    ("security", "no seccomp", lambda d: pod(workload(d, "worker"))["securityContext"].pop("seccompProfile")),
    ("resources", "no memory limit", lambda d: container(workload(d, "worker"))["resources"].pop("limits")),
    ("images", "a second image", lambda d: container(workload(d, "relay")).update(image="outbox:other")),
    (
        "services",
        "a name that sets a variable",
        lambda d: named(d, "Service", "outbox-relay")["metadata"].update(name="outbox-metrics"),
    ),
    (
        "services",
        "a job the alert misses",
        lambda d: named(d, "Service", "outbox-worker")["metadata"].update(name="outbox-workers"),
    ),
    ("scaling", "another target", lambda d: _scaled(d)["scaleTargetRef"].update(name="outbox-relay")),
    (
        "scaling",
        "a series nobody exports",
        lambda d: _scaled(d)["triggers"][0]["metadata"].update(query="sum(outbox_backlog)"),
    ),
    ("scaling", "scale to zero", lambda d: _scaled(d).update(minReplicaCount=0)),
    ("scaling", "replicas under KEDA", lambda d: workload(d, "worker")["spec"].update(replicas=3)),
    (
        "secrets",
        "a real password",
        lambda d: named(d, "Secret", "outbox-secrets")["stringData"].update(
            OUTBOX_REDIS_URL="redis://:hunter2@redis:6379/0"
        ),
    ),
    (
        "secrets",
        "a dashboard secret that works",
        lambda d: named(d, "Secret", "outbox-dashboard")["stringData"].update(
            OUTBOX_DASHBOARD_SECRET=PLACEHOLDER * 4
        ),
    ),
    (
        "secrets",
        "a users file that parses",
        lambda d: named(d, "Secret", "outbox-dashboard")["stringData"].update(
            users=f"# {PLACEHOLDER}\nadmin operate scrypt$16384$8$1$c2FsdA$aGFzaA\n"
        ),
    ),
]


@pytest.mark.parametrize(
    ("check", "breakage", "breaks"), BREAKAGES, ids=[f"{c}: {b}" for c, b, _ in BREAKAGES]
)
def test_each_check_refuses_a_broken_copy(
    check: str, breakage: str, breaks: Callable[[list[Doc]], None]
) -> None:
    docs = load()
    breaks(docs)
    assert CHECKS[check](docs), f"the {check} check let {breakage} through"


def test_every_check_is_shown_to_refuse_something() -> None:
    assert {c for c, _, _ in BREAKAGES} == set(CHECKS)


def test_scaling_to_zero_passes_with_the_waiting_rows_trigger_and_a_later_alert() -> None:
    """production.md's recipe: a second trigger on every waiting row, the alert's cycles raised."""
    docs = load()
    spec = _scaled(docs)
    spec["minReplicaCount"] = 0
    backlog = spec["triggers"][0]
    waiting = 'sum(max by (destination, state) (outbox_rows{state=~"pending|dispatched|in_flight"}))'
    spec["triggers"].append(
        {
            "type": "prometheus",
            "name": "outbox-waiting",
            "metricType": "AverageValue",
            "metadata": {**backlog["metadata"], "query": waiting, "threshold": "1000000"},
        }
    )
    assert "scales to zero while rows wait" not in " ".join(scaling_problems(docs))
    assert scaling_problems(docs), "the alert still comes after 30 s"
    _config(docs).update(OUTBOX_NO_CONSUMER_CYCLES="15")
    assert scaling_problems(docs) == []
    assert not list(scaledobject_validator().iter_errors(of_kind(docs, "ScaledObject")[0]))
    documented = (ROOT / "docs" / "production.md").read_text()
    assert waiting in documented and 'threshold: "1000000"' in documented


@pytest.mark.parametrize(
    ("query", "counted"),
    [
        ('sum(outbox_rows{state=~"dispatched|in_flight"})', False),
        ('sum(outbox_rows{state=~"pending|dispatched"})', True),
        ('sum(outbox_rows{state="pending"})', True),
        ('sum(outbox_rows{state!="failed"})', True),
        ('sum(outbox_rows{state!~"pending|failed"})', False),
        ("sum(outbox_rows)", True),
        ('sum(outbox_rows{destination="d"})', True),
    ],
)
def test_which_queries_count_pending_rows(query: str, counted: bool) -> None:
    assert counts_pending(query) is counted


# -- the backlog query, by promtool ------------------------------------------------------------------

PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian's prometheus package; .ci/run installs it): "
    "the ScaledObject's query is not evaluated on this machine",
)
def test_the_backlog_query_counts_what_workers_can_move(tmp_path: Path) -> None:
    """Two reconcilers exporting the same reading count once; pending rows (the relay's, some not
    due) and the rows of a paused destination or one whose breaker is open count none; without
    any reading the query answers nothing, which KEDA (ignoreNullValues: "false") takes as a
    failure and falls back on."""
    query = of_kind(load(), "ScaledObject")[0]["spec"]["triggers"][0]["metadata"]["query"]
    rules = {"groups": [{"name": "keda", "rules": [{"record": "outbox:worker_backlog", "expr": query}]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))

    def series(name: str, labels: dict[str, str], value: str) -> dict[str, str]:
        inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return {"series": f"{name}{{{inner}}}", "values": value}

    inputs = []
    for instance in ("reconciler-a", "reconciler-b"):
        for destination, dispatched, in_flight, paused, breaker in (
            ("payments.charge", 10, 6, 0, 0),
            ("mail.receipt", 100, 1, 1, 0),
            ("sms.send", 50, 0, 0, 1),
        ):
            base = {"destination": destination, "instance": instance, "job": "outbox-reconciler"}
            inputs += [
                series("outbox_rows", {**base, "state": "dispatched"}, f"{dispatched}x10"),
                series("outbox_rows", {**base, "state": "in_flight"}, f"{in_flight}x10"),
                series("outbox_rows", {**base, "state": "pending"}, "1000x10"),
                series("outbox_destination_paused", base, f"{paused}x10"),
                series("outbox_destination_breaker_open", base, f"{breaker}x10"),
            ]
    cases = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": inputs,
                "promql_expr_test": [
                    {
                        "expr": "outbox:worker_backlog",
                        "eval_time": "5m",
                        "exp_samples": [{"labels": "outbox:worker_backlog", "value": 16}],
                    }
                ],
            },
            {
                "interval": "1m",
                "input_series": [series("outbox_rows", {"destination": "d", "state": "pending"}, "5x10")],
                "promql_expr_test": [{"expr": "outbox:worker_backlog", "eval_time": "5m", "exp_samples": []}],
            },
        ],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(cases))
    proc = subprocess.run(
        [PROMTOOL, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
