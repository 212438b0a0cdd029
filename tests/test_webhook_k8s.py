"""`gpuvisor webhook` and deploy/ against the real kube-apiserver (make k8s).

The webhook runs as the real command, serving a certificate of the test
cluster's CA; the API server calls it over TLS through deploy/webhook.yaml's
MutatingWebhookConfiguration (its rules, selectors, matchConditions and
failurePolicy as shipped; only clientConfig points at the test's process).
deploy/rbac.yaml is applied and its least privilege checked with the API
server's own authorizer; the scheduler's KubeSchedulerConfiguration is
accepted by the real kube-scheduler; every core manifest passes a dry-run
create.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
import yaml
from kubernetes.client.rest import ApiException
from kubernetes.utils import parse_quantity

from tests.helpers import REPO_ROOT
from tests.k8s_cluster import GPU, GPUCORES, GPUMEM, KubeTest, gpu_container, gpu_pod
from tests.test_webhook import issue, start_webhook, wait_serving

DEPLOY = REPO_ROOT / "deploy"


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def webhook_config(
    port: int, ca_file: Path, name: str, kind: str = "MutatingWebhookConfiguration"
) -> dict[str, Any]:
    """deploy/webhook.yaml's configuration of `kind`, calling
    https://127.0.0.1:port at its service path (/mutate, /validate)."""
    (config,) = [d for d in documents("webhook.yaml") if d["kind"] == kind]
    config = copy.deepcopy(config)
    config["metadata"]["name"] = name
    (hook,) = config["webhooks"]
    hook["clientConfig"] = {
        "url": f"https://127.0.0.1:{port}{hook['clientConfig']['service']['path']}",
        "caBundle": base64.b64encode(ca_file.read_bytes()).decode(),
    }
    return config


@pytest.fixture
def webhook(k8s: KubeTest, tmp_path: Path) -> Iterator[Any]:
    """`gpuvisor webhook` registered with the cluster as deploy/webhook.yaml does."""
    cert, key = issue(k8s.cluster.ca, tmp_path)
    proc = start_webhook(cert, key)
    try:
        port = wait_serving(proc)
        k8s.create_mutating_webhook(
            webhook_config(port, k8s.cluster.ca_file, f"gpuvisor-{k8s.namespace}")
        )
        k8s.create_validating_webhook(
            webhook_config(
                port,
                k8s.cluster.ca_file,
                f"gpuvisor-guard-{k8s.namespace}",
                "ValidatingWebhookConfiguration",
            )
        )
        yield proc
    finally:
        proc.terminate()
        proc.wait(10)


def limits_of(pod: kubernetes.client.V1Pod, index: int = 0) -> dict[str, int]:
    resources = pod.spec.containers[index].resources
    return {k: int(parse_quantity(v)) for k, v in (resources.limits or {}).items()}


def api_error(k8s: KubeTest, name: str, **kwargs: Any) -> tuple[int, str]:
    """The status code and message of the API server's refusal to create the pod."""
    with pytest.raises(ApiException) as error:
        k8s.create_pod(name, **kwargs)
    return int(error.value.status), str(json.loads(error.value.body)["message"])


def test_a_gpu_pod_is_admitted_with_the_scheduler_and_defaults(k8s: KubeTest, webhook: Any) -> None:
    pod = k8s.create_pod("shared", gpus=1, gpumem=3000, gpucores=30)
    assert pod.spec.scheduler_name == "gpuvisor-scheduler"
    assert limits_of(pod) == {GPU: 1, GPUMEM: 3000, GPUCORES: 30}

    # HAMi's defaults, written into the stored pod: one GPU for a memory
    # request, all the cores for a whole GPU.
    pod = k8s.create_pod(
        "defaults",
        containers=[gpu_container("mem", gpumem=3000), gpu_container("whole", gpus=1)],
    )
    assert pod.spec.scheduler_name == "gpuvisor-scheduler"
    assert limits_of(pod, 0) == {GPU: 1, GPUMEM: 3000}
    assert limits_of(pod, 1) == {GPU: 1, GPUCORES: 100}
    # The API server defaults the patched pod again: the limits added are
    # copied to requests, as for limits the user wrote.
    assert pod.spec.containers[0].resources.requests == {GPU: "1", GPUMEM: "3k"}


def test_a_bad_request_is_refused_with_the_fields_message(k8s: KubeTest, webhook: Any) -> None:
    status, message = api_error(
        k8s,
        "both",
        containers=[
            {
                **gpu_container(gpus=1),
                "resources": {"limits": {GPU: "1", GPUMEM: "3000", GPU + "mem-percentage": "50"}},
            }
        ],
    )
    assert status == 400
    assert message == (
        'admission webhook "webhook.gpuvisor.io" denied the request: '
        "spec.containers[0].resources.limits[nvidia.com/gpumem-percentage]: "
        "set together with nvidia.com/gpumem; give one of the two"
    )

    status, message = api_error(
        k8s, "policy", gpus=1, annotations={"hami.io/gpu-scheduler-policy": "densest"}
    )
    assert status == 400
    assert message == (
        'admission webhook "webhook.gpuvisor.io" denied the request: '
        "metadata.annotations[hami.io/gpu-scheduler-policy]: unknown value 'densest', "
        "expected one of binpack, spread, topology-aware"
    )
    assert not k8s.core.list_namespaced_pod(k8s.namespace).items


def test_a_pod_without_gpus_is_untouched_and_never_sent(k8s: KubeTest, webhook: Any) -> None:
    pod = k8s.create_pod("plain")
    assert pod.spec.scheduler_name == "default-scheduler"
    assert pod.spec.containers[0].resources.limits is None
    # matchConditions: the API server does not call the webhook for it, so
    # with the webhook gone it is still created ...
    webhook.terminate()
    webhook.wait(10)
    assert k8s.create_pod("plain-2").spec.scheduler_name == "default-scheduler"
    # ... while a GPU pod fails closed (failurePolicy: Fail): it is not left
    # to the default scheduler, whose pods gpuvisor's device plugin refuses.
    status, message = api_error(k8s, "gpu", gpus=1)
    assert status == 500
    assert 'failed calling webhook "webhook.gpuvisor.io"' in message, message
    # An opt-out label skips the webhook altogether.
    pod = k8s.create_pod("opted-out", gpus=1, labels={"gpuvisor.io/webhook": "ignore"})
    assert pod.spec.scheduler_name == "default-scheduler"


def test_the_scheduler_configuration_is_accepted_by_kube_scheduler(k8s: KubeTest) -> None:
    (config_map,) = [d for d in documents("scheduler.yaml") if d["kind"] == "ConfigMap"]
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    extender = config["extenders"][0]
    assert extender["urlPrefix"] == "https://127.0.0.1:8888"
    assert extender["enableHTTPS"] is True
    assert extender["tlsConfig"] == {"caFile": "/etc/gpuvisor-scheduler-tls/ca.crt"}
    assert {r["name"] for r in extender["managedResources"]} == {
        GPU,
        GPUMEM,
        GPUCORES,
        "nvidia.com/gpumem-percentage",
    }
    # The test cluster has no gpuvisor namespace for the Lease.
    config["leaderElection"] = {"leaderElect": False}
    # nor the Secret's CA there: a CA file of its own (kube-scheduler reads it at start)
    extender["tlsConfig"]["caFile"] = str(k8s.cluster.ca_file)
    scheduler = k8s.start_scheduler(config)
    assert scheduler.config["profiles"] == [{"schedulerName": "gpuvisor-scheduler"}]


def allowed(
    authz: kubernetes.client.AuthorizationV1Api, user: str, verb: str, resource: str, **attrs: str
) -> bool:
    group, _, subresource = "", "", ""
    if "/" in resource:
        resource, subresource = resource.split("/", 1)
    review = kubernetes.client.V1SubjectAccessReview(
        spec=kubernetes.client.V1SubjectAccessReviewSpec(
            user=user,
            groups=["system:serviceaccounts", "system:serviceaccounts:gpuvisor"],
            resource_attributes=kubernetes.client.V1ResourceAttributes(
                group=attrs.pop("group", group),
                resource=resource,
                subresource=subresource,
                verb=verb,
                **attrs,
            ),
        )
    )
    return bool(authz.create_subject_access_review(review).status.allowed)


# What deploy/rbac.yaml may hold.
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


def test_rbac_applies_and_grants_each_component_only_what_it_uses(k8s: KubeTest) -> None:
    from kubernetes.dynamic import DynamicClient
    from kubernetes.dynamic.exceptions import DynamicApiError

    api = k8s.cluster.api
    dynamic = DynamicClient(api)
    created: list[tuple[Any, str, str | None]] = []
    with contextlib.suppress(ApiException):
        kubernetes.client.CoreV1Api(api).create_namespace({"metadata": {"name": "gpuvisor"}})
    try:
        for doc in documents("rbac.yaml"):
            kind, name = doc["kind"], doc["metadata"]["name"]
            if kind not in RBAC_KINDS:
                pytest.fail(f"rbac.yaml: unexpected {kind}")
            namespace = doc["metadata"].get("namespace")
            resource = dynamic.resources.get(api_version=doc["apiVersion"], kind=kind)
            resource.create(body=doc, namespace=namespace)
            created.append((resource, name, namespace))

        authz = kubernetes.client.AuthorizationV1Api(api)
        extender = "system:serviceaccount:gpuvisor:gpuvisor-scheduler"
        plugin = "system:serviceaccount:gpuvisor:gpuvisor-device-plugin"
        ns = k8s.namespace
        for verb, resource in (("list", "nodes"), ("watch", "pods"), ("patch", "pods")):
            assert allowed(authz, extender, verb, resource, namespace=ns), (verb, resource)
        assert allowed(authz, extender, "create", "pods/binding", namespace=ns)
        assert allowed(authz, extender, "update", "leases", group="coordination.k8s.io",
                       namespace="gpuvisor", name="gpuvisor-scheduler")  # fmt: skip
        # (kube-scheduler's own role deletes pods: preemption)
        for verb, resource in (("create", "pods"), ("patch", "nodes"), ("get", "secrets")):
            assert not allowed(authz, extender, verb, resource, namespace=ns), (verb, resource)

        assert allowed(authz, plugin, "get", "pods", namespace=ns)
        assert allowed(authz, plugin, "patch", "nodes", name="gpu-node-1")
        for verb, resource in (("patch", "pods"), ("create", "pods/binding"), ("delete", "nodes")):
            assert not allowed(authz, plugin, verb, resource, namespace=ns), (verb, resource)
    finally:
        for resource, name, namespace in reversed(created):
            with contextlib.suppress(DynamicApiError):
                resource.delete(name=name, namespace=namespace)


def test_every_manifest_passes_the_api_servers_validation(k8s: KubeTest) -> None:
    """deploy/'s core objects, created with dryRun=All and strict field
    validation: the real API server's (v1.34) admission and validation,
    nothing stored."""
    from kubernetes.dynamic import DynamicClient
    from kubernetes.dynamic.exceptions import DynamicApiError

    with contextlib.suppress(ApiException):
        k8s.core.create_namespace({"metadata": {"name": "gpuvisor"}})
    dynamic = DynamicClient(k8s.cluster.api)
    checked = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["apiVersion"].startswith("monitoring.coreos.com/"):
                continue
            resource = dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            namespace = doc["metadata"].get("namespace")
            if namespace not in ("gpuvisor", "kube-system"):
                # the example Pod: in the test's namespace (default has no
                # ServiceAccount here: no controller-manager runs)
                doc = {**doc, "metadata": {**doc["metadata"], "namespace": k8s.namespace}}
                namespace = k8s.namespace
            try:
                resource.create(
                    body=doc,
                    namespace=namespace if resource.namespaced else None,
                    query_params=[("dryRun", "All"), ("fieldValidation", "Strict")],
                )
            except DynamicApiError as exc:
                if doc["kind"] == "Namespace" and exc.status == 409:
                    continue  # the test made it above
                message = json.loads(exc.body)["message"]
                pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']}: {message}")
            checked.append(doc["kind"])
    assert {"Deployment", "DaemonSet", "MutatingWebhookConfiguration", "ClusterRole"} <= set(
        checked
    )


# ---- who may write gpuvisor.io/allocation (the ValidatingWebhookConfiguration) ----

ANNOTATION = "gpuvisor.io/allocation"
EXTENDER = "system:serviceaccount:gpuvisor:gpuvisor-scheduler"  # --allocation-writer's default
GUARD = 'admission webhook "allocation.gpuvisor.io" denied the request: '


def as_user(k8s: KubeTest, user: str) -> kubernetes.client.CoreV1Api:
    """The API as `user` (the admin impersonating it), who may create,
    update and delete pods of the test's namespace and update their status
    (a Role of its own: the built-in `edit` is aggregated by the
    controller-manager, which the test cluster does not run)."""
    rbac = kubernetes.client.RbacAuthorizationV1Api(k8s.cluster.api)
    name = "pod-editor-" + "".join(c if c.isalnum() else "-" for c in user)
    group = "rbac.authorization.k8s.io"
    with contextlib.suppress(ApiException):
        rbac.create_namespaced_role(
            k8s.namespace,
            {
                "metadata": {"name": "pod-editor"},
                "rules": [
                    {
                        "apiGroups": [""],
                        "resources": ["pods", "pods/status"],
                        "verbs": ["get", "list", "create", "update", "patch", "delete"],
                    }
                ],
            },
        )
    rbac.create_namespaced_role_binding(
        k8s.namespace,
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": group, "kind": "Role", "name": "pod-editor"},
            "subjects": [{"apiGroup": group, "kind": "User", "name": user}],
        },
    )
    client = kubernetes.client.ApiClient(k8s.cluster.api.configuration)
    client.set_default_header("Impersonate-User", user)
    return kubernetes.client.CoreV1Api(client)


def refused(call: Any, *args: Any, **kwargs: Any) -> tuple[int, str]:
    """The status code and message of the API server's refusal of the call."""
    with pytest.raises(ApiException) as error:
        call(*args, **kwargs)
    return int(error.value.status), str(json.loads(error.value.body)["message"])


def record_of(k8s: KubeTest, name: str) -> str | None:
    annotations = k8s.read_pod(name).metadata.annotations or {}
    value = annotations.get(ANNOTATION)
    return str(value) if value is not None else None


def test_only_the_extender_writes_the_allocation_record(k8s: KubeTest, webhook: Any) -> None:
    """A tenant can neither create a pod with the record nor set, change
    or remove it afterwards (through the pod or its status); the Binding
    writes it as before; the extender's identity may write it; the
    tenant's other annotations and labels are theirs."""
    alice = as_user(k8s, "alice")
    record = '{"version":1,"pod":"x/y","node":"gx-1","containers":[]}'
    raised = record.replace("[]", '[{"name":"main","gpus":[]}]')
    ns = k8s.namespace

    def create(name: str, **kwargs: Any) -> Any:
        pod = kubernetes.client.V1Pod.from_dict(gpu_pod(name, **kwargs))
        return alice.create_namespaced_pod(ns, pod)

    # at creation: a GPU pod, and a pod that asks for none and opts out of
    # the mutating webhook (the guard has no selector to opt out of)
    for name, kwargs in (
        ("gpu", {"gpus": 1, "gpumem": 3000}),
        ("plain", {"labels": {"gpuvisor.io/webhook": "ignore"}}),
    ):
        status, message = refused(create, name, annotations={ANNOTATION: record}, **kwargs)
        assert (status, message) == (
            403,
            f"{GUARD}metadata.annotations[{ANNOTATION}]: set at creation by alice; only the "
            f"scheduler extender ({EXTENDER}) writes it, in the pod's Binding",
        )
    assert not k8s.core.list_namespaced_pod(ns).items

    # the Binding carries the record onto the pod (pods/binding: not a pod write)
    create("mine", gpus=1, gpumem=3000)
    assert record_of(k8s, "mine") is None
    binding = kubernetes.client.V1Binding(
        metadata=kubernetes.client.V1ObjectMeta(name="mine", annotations={ANNOTATION: record}),
        target=kubernetes.client.V1ObjectReference(kind="Node", name="gx-1"),
    )
    k8s.core.create_namespaced_pod_binding("mine", ns, binding, _preload_content=False)
    assert record_of(k8s, "mine") == record

    # changed or removed by the tenant: through the pod and through its status
    for value, done in ((raised, "changed"), (None, "removed")):
        body = {"metadata": {"annotations": {ANNOTATION: value}}}
        for patch in (alice.patch_namespaced_pod, alice.patch_namespaced_pod_status):
            status, message = refused(patch, "mine", ns, body)
            assert status == 403, message
            assert message.startswith(
                f"{GUARD}metadata.annotations[{ANNOTATION}]: {done} by alice; "
            ), message
    assert record_of(k8s, "mine") == record

    # the tenant's other metadata is theirs
    alice.patch_namespaced_pod(
        "mine", ns, {"metadata": {"labels": {"team": "a"}, "annotations": {"note": "x"}}}
    )
    assert k8s.read_pod("mine").metadata.labels["team"] == "a"
    # the extender's identity may write it
    as_user(k8s, EXTENDER).patch_namespaced_pod(
        "mine", ns, {"metadata": {"annotations": {ANNOTATION: raised}}}
    )
    assert record_of(k8s, "mine") == raised

    # the webhook down: a write of the record fails closed, any other goes through
    webhook.terminate()
    webhook.wait(10)
    alice.patch_namespaced_pod("mine", ns, {"metadata": {"annotations": {"note": "y"}}})
    status, message = refused(
        alice.patch_namespaced_pod, "mine", ns, {"metadata": {"annotations": {ANNOTATION: None}}}
    )
    assert status == 500
    assert 'failed calling webhook "allocation.gpuvisor.io"' in message, message
    assert record_of(k8s, "mine") == raised
