"""`gpuvisor webhook`: the admission decision (unit) and the server (TLS,
certificate reload).  Through the real kube-apiserver: tests/test_webhook_k8s.py.
"""

from __future__ import annotations

import copy
import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from gpuvisor.cluster.allocation import ANNOTATION
from gpuvisor.cluster.inventory_model import DocumentError
from gpuvisor.cluster.request import GPU, pod_request
from gpuvisor.cluster.webhook.guard import guard
from gpuvisor.cluster.webhook.review import (
    API_VERSION,
    ReviewError,
    WebhookConfig,
    admit,
    patch_of,
)

CONFIG = WebhookConfig()


def pod(
    limits: dict[str, str] | None = None,
    *,
    annotations: dict[str, str] | None = None,
    requests: dict[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if limits:
        resources["limits"] = limits
    if requests:
        resources["requests"] = requests
    container: dict[str, Any] = {"name": "main", "image": "busybox"}
    if resources:
        container["resources"] = resources
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "train", "annotations": annotations or {}},
        "spec": {"containers": [container], **spec},
    }


def review(obj: Any, operation: str = "CREATE", kind: str = "Pod") -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "AdmissionReview",
        "request": {
            "uid": "7c3e-uid",
            "kind": {"group": "", "version": "v1", "kind": kind},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "ml",
            "operation": operation,
            "object": obj,
        },
    }


def answer(obj: Any, config: WebhookConfig = CONFIG, **kwargs: Any) -> dict[str, Any]:
    out: dict[str, Any] = admit(review(obj, **kwargs), config)
    assert out["apiVersion"] == API_VERSION
    assert out["kind"] == "AdmissionReview"
    assert out["response"]["uid"] == "7c3e-uid"
    return out


def apply(patch: Any, obj: dict[str, Any]) -> dict[str, Any]:
    """Applies the "add"/"replace" operations the webhook emits (RFC 6902 subset)."""
    out = copy.deepcopy(obj)
    for op in patch:
        assert op["op"] in ("add", "replace"), op
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]
        ]
        target: Any = out
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if op["op"] == "add":
            assert last not in target, f"add over an existing {op['path']}"
        target[last] = op["value"]
    return out


def denied(obj: Any) -> str:
    response = answer(obj)["response"]
    assert response["allowed"] is False, response
    assert "patch" not in response
    assert response["status"]["code"] == 400
    message: str = response["status"]["message"]
    assert "\n" not in message
    return message


# ---- pods that pass unchanged ----------------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [
        pod(),
        pod({"cpu": "1", "memory": "1Gi"}),
        # a policy annotation alone asks for no GPU: not the webhook's business
        pod(annotations={"hami.io/gpu-scheduler-policy": "nonsense"}),
    ],
    ids=["no resources", "cpu and memory", "annotation only"],
)
def test_a_pod_without_gpu_resources_passes_unchanged(obj: dict[str, Any]) -> None:
    response = answer(obj)["response"]
    assert response == {"uid": "7c3e-uid", "allowed": True}


def test_other_operations_and_kinds_pass_unchanged() -> None:
    gpu = pod({"nvidia.com/gpumem": "1000", "nvidia.com/gpumem-percentage": "50"})
    for kwargs in ({"operation": "UPDATE"}, {"operation": "DELETE"}, {"kind": "Deployment"}):
        assert answer(gpu, **kwargs)["response"] == {"uid": "7c3e-uid", "allowed": True}


# ---- admitted GPU pods: scheduler and defaults -----------------------------------------


def test_a_full_request_gets_only_the_scheduler_name() -> None:
    obj = pod({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"})
    response = answer(obj)["response"]
    assert response["allowed"] is True
    assert response["patchType"] == "JSONPatch"
    assert patch_of(answer(obj)) == [
        {"op": "add", "path": "/spec/schedulerName", "value": "gpuvisor-scheduler"}
    ]


def test_memory_alone_gets_one_gpu_as_hami_defaults() -> None:
    obj = pod({"nvidia.com/gpumem": "3000"})
    patched = apply(patch_of(answer(obj)), obj)
    limits = patched["spec"]["containers"][0]["resources"]["limits"]
    # HAMi's defaultGPUNum; cores stay unset (0: shared, no SM limit)
    assert limits == {"nvidia.com/gpumem": "3000", "nvidia.com/gpu": "1"}
    assert patched["spec"]["schedulerName"] == "gpuvisor-scheduler"


def test_a_whole_gpu_gets_all_its_cores() -> None:
    for limits in (
        {"nvidia.com/gpu": "2"},
        {"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "100"},
    ):
        obj = pod(limits)
        patched = apply(patch_of(answer(obj)), obj)
        assert patched["spec"]["containers"][0]["resources"]["limits"] == {
            **limits,
            "nvidia.com/gpucores": "100",
        }


def test_defaults_are_the_parsers() -> None:
    """What the patch writes out is what pod_request would assume: the
    patched pod parses to the same request as the original."""
    cases = [
        pod({"nvidia.com/gpumem": "3000"}),
        pod({"nvidia.com/gpucores": "20"}),
        pod({"nvidia.com/gpumem-percentage": "25"}),
        pod({"nvidia.com/gpu": "2"}),
        pod(requests={"nvidia.com/gpumem": "3k"}),
        pod({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}),
    ]
    for obj in cases:
        obj["metadata"]["namespace"] = "ml"
        patched = apply(patch_of(answer(obj)), obj)
        assert pod_request(patched) == pod_request(obj), obj
        assert pod_request(patched).wants_gpu


def test_containers_without_resources_and_init_containers_are_patched_in_place() -> None:
    obj = pod()
    obj["spec"]["initContainers"] = [
        {
            "name": "fetch",
            "image": "busybox",
            "resources": {"requests": {"nvidia.com/gpucores": "10"}},
        }
    ]
    obj["spec"]["containers"].append(
        {"name": "side", "image": "busybox", "resources": {"limits": {"nvidia.com/gpumem": "500"}}}
    )
    patched = apply(patch_of(answer(obj)), obj)
    (init,) = patched["spec"]["initContainers"]
    assert init["resources"] == {
        "requests": {"nvidia.com/gpucores": "10"},
        "limits": {"nvidia.com/gpu": "1"},
    }
    main, side = patched["spec"]["containers"]
    assert "resources" not in main
    assert side["resources"]["limits"] == {"nvidia.com/gpumem": "500", "nvidia.com/gpu": "1"}


def test_the_scheduler_name_is_configurable_and_replaces_the_default() -> None:
    obj = pod(
        {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "50"}, schedulerName="default-scheduler"
    )
    patch = patch_of(answer(obj, WebhookConfig(scheduler_name="gpu-sched")))
    assert patch == [{"op": "replace", "path": "/spec/schedulerName", "value": "gpu-sched"}]
    obj["spec"]["schedulerName"] = "gpu-sched"
    assert "patch" not in answer(obj, WebhookConfig(scheduler_name="gpu-sched"))["response"]


def test_a_pod_naming_another_scheduler_is_left_alone_with_a_warning() -> None:
    obj = pod({"nvidia.com/gpu": "1"}, schedulerName="volcano")
    response = answer(obj)["response"]
    assert response["allowed"] is True
    assert "patch" not in response
    (warning,) = response["warnings"]
    assert "'volcano'" in warning
    assert "gpuvisor-scheduler" in warning


def test_a_pod_made_from_generate_name_is_read() -> None:
    obj = pod({"nvidia.com/gpumem": "1000"})
    obj["metadata"] = {"generateName": "train-"}
    assert answer(obj)["response"]["allowed"] is True


# ---- refused: one line naming the field and the value ----------------------------------


def test_gpumem_and_percentage_together_are_refused() -> None:
    message = denied(pod({"nvidia.com/gpumem": "3000", "nvidia.com/gpumem-percentage": "50"}))
    assert message == (
        "spec.containers[0].resources.limits[nvidia.com/gpumem-percentage]: "
        "set together with nvidia.com/gpumem; give one of the two"
    )


@pytest.mark.parametrize(
    ("annotations", "limits", "expected"),
    [
        (
            {"hami.io/gpu-scheduler-policy": "pack"},
            {"nvidia.com/gpu": "1"},
            "metadata.annotations[hami.io/gpu-scheduler-policy]: unknown value 'pack', "
            "expected one of binpack, spread, topology-aware",
        ),
        (
            {"hami.io/node-scheduler-policy": "least"},
            {"nvidia.com/gpu": "1"},
            "metadata.annotations[hami.io/node-scheduler-policy]: unknown value 'least', "
            "expected one of binpack, spread",
        ),
        (
            {"nvidia.com/vgpu-mode": "mps"},
            {"nvidia.com/gpu": "1"},
            "metadata.annotations[nvidia.com/vgpu-mode]: unknown value 'mps', "
            "expected hami-core or mig",
        ),
        (
            {},
            {"nvidia.com/gpucores": "150"},
            "spec.containers[0].resources.limits[nvidia.com/gpucores]: expected 0..100, got '150'",
        ),
        (
            {},
            {"nvidia.com/gpumem": "0"},
            "spec.containers[0].resources.limits[nvidia.com/gpumem]: expected >= 1, got '0'",
        ),
        (
            {},
            {"nvidia.com/gpumem": "8Gi"},
            "spec.containers[0].resources.limits[nvidia.com/gpumem]: "
            "expected a whole number, got '8Gi'",
        ),
        (
            {},
            {"nvidia.com/gpumem": "500m"},
            "spec.containers[0].resources.limits[nvidia.com/gpumem]: "
            "expected a whole number, got '500m'",
        ),
        (
            {"gpuvisor.io/sm-policy": "greedy"},
            {"nvidia.com/gpu": "1"},
            "metadata.annotations[gpuvisor.io/sm-policy]: unknown value 'greedy', "
            "expected one of fixed-share, burst-share, best-effort",
        ),
    ],
)
def test_bad_requests_are_refused_by_the_allocators_parser(
    annotations: dict[str, str], limits: dict[str, str], expected: str
) -> None:
    obj = pod(limits, annotations=annotations)
    message = denied(obj)
    with pytest.raises(DocumentError) as parsed:
        pod_request(obj)
    assert message == str(parsed.value) == expected


def test_a_preset_node_name_is_refused() -> None:
    message = denied(pod({"nvidia.com/gpu": "1"}, nodeName="gpu-node-1"))
    assert message.startswith("spec.nodeName: set to 'gpu-node-1', which bypasses")
    assert "nodeSelector" in message


def test_a_privileged_gpu_container_is_refused() -> None:
    obj = pod({"nvidia.com/gpu": "1"})
    obj["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    assert denied(obj).startswith("spec.containers[0].securityContext.privileged: true")
    # a privileged container that asks for no GPU is not the webhook's business
    obj["spec"]["containers"][0]["resources"] = {}
    assert answer(obj)["response"] == {"uid": "7c3e-uid", "allowed": True}


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {}},
        {"apiVersion": API_VERSION, "kind": "AdmissionReview"},
        {"apiVersion": API_VERSION, "kind": "AdmissionReview", "request": {"uid": 7}},
    ],
)
def test_a_malformed_review_is_an_error(body: Any) -> None:
    with pytest.raises(ReviewError):
        admit(body, CONFIG)


def test_hostile_pod_shapes_never_crash() -> None:
    shapes: list[Any] = [
        None,
        "pod",
        {"spec": None},
        {"spec": {"containers": "x"}},
        {"spec": {"containers": [None, {"resources": "x"}]}},
        {"spec": {"containers": [{"name": "a", "resources": {"limits": {"nvidia.com/gpu": [1]}}}]}},
        {
            "metadata": "x",
            "spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
        },
    ]
    for obj in shapes:
        response = answer(obj)["response"]
        if not response["allowed"]:
            assert "\n" not in response["status"]["message"]


# ---- the server: TLS, HTTP errors, certificate reload ----------------------------------


def issue(ca: trustme.CA, directory: Path) -> tuple[Path, Path]:
    leaf = ca.issue_cert("127.0.0.1")
    cert, key = directory / "tls.crt", directory / "tls.key"
    for path, data in (
        (cert, b"".join(b.bytes() for b in leaf.cert_chain_pems)),
        (key, leaf.private_key_pem.bytes()),
    ):
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)  # as the kubelet swaps a Secret volume's files
    return cert, key


class Served:
    def __init__(self, proc: subprocess.Popen[str], port: int, ca: trustme.CA) -> None:
        self.proc, self.port = proc, port
        self.client = ssl.create_default_context()
        ca.configure_trust(self.client)

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        request = urllib.request.Request(
            f"https://127.0.0.1:{self.port}{path}",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, context=self.client, timeout=10) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def peer_certificate(self) -> bytes:
        with (
            socket.create_connection(("127.0.0.1", self.port), timeout=10) as raw,
            self.client.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            der = tls.getpeercert(binary_form=True)
        assert der is not None
        return der


def start_webhook(cert: Path, key: Path, *extra: str) -> subprocess.Popen[str]:
    gpuvisor = shutil.which("gpuvisor", path=str(Path(sys.executable).parent))
    assert gpuvisor, "the venv's gpuvisor command"
    return subprocess.Popen(
        [
            gpuvisor,
            "webhook",
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--bind-address",
            "127.0.0.1",
            "--port",
            "0",
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_serving(proc: subprocess.Popen[str]) -> int:
    """The port from the webhook's "serving https://host:port/mutate" line."""
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            pytest.fail(f"gpuvisor webhook exited with {proc.wait()}", pytrace=False)
        if "serving https://" in line:
            return int(line.split("serving https://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
    pytest.fail("gpuvisor webhook did not start serving in 30 s", pytrace=False)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Served, trustme.CA, Path]]:
    ca = trustme.CA()
    cert, key = issue(ca, tmp_path)
    proc = start_webhook(cert, key)
    try:
        yield Served(proc, wait_serving(proc), ca), ca, tmp_path
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_the_server_answers_reviews_over_tls(served: tuple[Served, trustme.CA, Path]) -> None:
    server, _, _ = served
    body = json.dumps(
        review(pod({"nvidia.com/gpumem": "3000", "nvidia.com/gpumem-percentage": "5"}))
    )
    status, data = server.post("/mutate", body.encode())
    assert status == 200
    response = json.loads(data)["response"]
    assert response["allowed"] is False
    assert "gpumem-percentage" in response["status"]["message"]
    assert server.post("/mutate", b"{not json")[0] == 400
    assert server.post("/mutate", json.dumps({"kind": "Pod"}).encode())[0] == 400
    assert server.post("/other", b"{}")[0] == 404


def test_a_renewed_certificate_is_served_without_a_restart(
    served: tuple[Served, trustme.CA, Path],
) -> None:
    server, ca, directory = served
    before = server.peer_certificate()
    issue(ca, directory)
    after = server.peer_certificate()
    assert after != before
    first_pem = (directory / "tls.crt").read_text().split("-----END CERTIFICATE-----")[0]
    assert after == ssl.PEM_cert_to_DER_cert(first_pem + "-----END CERTIFICATE-----\n")
    # a half-written pair keeps the previous one in service
    (directory / "tls.key").write_text("not a key\n")
    assert server.peer_certificate() == after
    assert server.proc.poll() is None


def test_a_missing_certificate_is_one_line(tmp_path: Path) -> None:
    proc = start_webhook(tmp_path / "none.crt", tmp_path / "none.key")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert (
        err.strip().splitlines()[-1] == f"Error: {tmp_path / 'none.crt'}: No such file or directory"
    )


# ---- /validate: who may write gpuvisor.io/allocation (guard.py) ----

RECORD = '{"version":1,"pod":"ml/train","node":"n1","containers":[]}'


def guarded(
    new: dict[str, Any],
    old: dict[str, Any] | None = None,
    user: str = "alice",
    sub: str = "",
    config: WebhookConfig = CONFIG,
) -> dict[str, Any]:
    """guard's response to `user` creating `new` (or updating `old` to it)."""
    r = review(new, operation="CREATE" if old is None else "UPDATE")
    r["request"]["userInfo"] = {"username": user, "groups": ["system:authenticated"]}
    if old is not None:
        r["request"]["oldObject"] = old
    if sub:
        r["request"]["subResource"] = sub
    out: dict[str, Any] = guard(r, config)
    assert out["response"]["uid"] == "7c3e-uid"
    return dict(out["response"])


def test_the_guard_refuses_the_record_to_anyone_but_its_writers() -> None:
    mine = pod({GPU: "1"}, annotations={ANNOTATION: RECORD})
    bare = pod({GPU: "1"})
    raised = pod({GPU: "1"}, annotations={ANNOTATION: RECORD.replace("[]", '[{"name":"main"}]')})
    extender = "system:serviceaccount:gpuvisor:gpuvisor-scheduler"
    for new, old, done in (
        (mine, None, "set at creation"),
        (mine, bare, "set"),
        (raised, mine, "changed"),
        (bare, mine, "removed"),
    ):
        for sub in ("", "status"):
            got = guarded(new, old, sub=sub)
            assert not got["allowed"]
            assert got["status"] == {
                "code": 403,
                "reason": "Forbidden",
                "message": f"metadata.annotations[{ANNOTATION}]: {done} by alice; only the "
                f"scheduler extender ({extender}) writes it, in the pod's Binding",
            }
            assert guarded(new, old, user=extender, sub=sub)["allowed"]
    # untouched: allowed, whoever writes and whatever else changes
    labelled = pod({GPU: "1"}, annotations={ANNOTATION: RECORD, "note": "x"})
    assert guarded(labelled, mine)["allowed"]
    assert guarded(bare)["allowed"]
    # configured writers replace the default
    config = WebhookConfig(allocation_writers=("ops", "bot"))
    assert guarded(raised, mine, user="ops", config=config)["allowed"]
    got = guarded(raised, mine, user=extender, config=config)
    assert "only the scheduler extender (ops, bot) writes it" in got["status"]["message"]
    # subresources that carry no metadata, and other kinds, are not its business
    assert guarded(raised, mine, sub="ephemeralcontainers")["allowed"]
    r = review(mine, kind="ConfigMap")
    assert guard(r, CONFIG)["response"]["allowed"]
    with pytest.raises(ReviewError):
        guard({"kind": "AdmissionReview"}, CONFIG)
