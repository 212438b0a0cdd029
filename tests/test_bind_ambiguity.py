"""The extender's bind guard (cluster/scheduler/state.py `ambiguity`,
extender.py `_commit`), without Kubernetes: kubelet does not tell the device
plugin which pod it admits, and the plugin steers a container to the GPUs of
the oldest pod bound to the node and not started with as many GPUs; so a pod
is not bound beside a not-started pod with a same-sized container on other
GPUs.  It is placed on that pod's GPUs where it fits, else the bind is
refused with one line naming the pod it waits for, until that one starts.

The API is an in-memory stand-in for the two calls bind makes (read,
binding); the pods' status comes in through `pod_event`, as the
extender's watch delivers it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import kubernetes.client
import pytest
from gpuvisor.cluster.allocation import ANNOTATION
from gpuvisor.cluster.allocator import Allocator, Config
from gpuvisor.cluster.deviceplugin.publish import NODE_INVENTORY
from gpuvisor.cluster.inventory_model import load_inventory
from gpuvisor.cluster.request import GPU_POLICY, pod_request
from gpuvisor.cluster.scheduler.api_view import view
from gpuvisor.cluster.scheduler.binding import ApiError
from gpuvisor.cluster.scheduler.extender import EXPLAINED_NODES, Extender
from gpuvisor.cluster.scheduler.state import Ambiguous, ClusterState
from gpuvisor.cluster.scheduler.wake import Wake

from tests.inventories import cluster, ctr, pcie_box, pod

API = kubernetes.client.ApiClient()
SPREAD = {GPU_POLICY: "spread"}


def v1pod(doc: dict[str, Any]) -> kubernetes.client.V1Pod:
    out: kubernetes.client.V1Pod = API.deserialize(json.dumps(doc), "V1Pod", "application/json")
    return out


class Raw:
    """An undecoded answer (`_preload_content=False`)."""

    def __init__(self, data: bytes) -> None:
        self.data = data


class Pods:
    """The pods of the API server, as bind reads and writes them."""

    def __init__(self) -> None:
        self.docs: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.writes: list[dict[str, Any]] = []  # the Bindings bind wrote
        self.reads = 0

    def add(self, doc: dict[str, Any]) -> None:
        self.version += 1
        meta = doc["metadata"]
        meta.update(uid=f"uid-{meta['name']}", resourceVersion=str(self.version))
        doc.setdefault("status", {"phase": "Pending"})
        for c in doc["spec"]["containers"] + doc["spec"].get("initContainers", []):
            limits = c["resources"]["limits"]  # the API stores quantities as strings
            limits.update((k, str(v)) for k, v in limits.items())
        self.docs[meta["name"]] = doc

    def read_namespaced_pod(self, name: str, namespace: str, **kw: Any) -> Any:
        self.reads += 1
        if kw.get("_preload_content", True):
            return v1pod(self.docs[name])
        return Raw(json.dumps(self.docs[name]).encode())

    async def bind(self, namespace: str, name: str, b: dict[str, Any]) -> None:
        """The Binder's write (cluster/scheduler/binding.py), as the API
        server answers it: the Binding's uid and resourceVersion are
        preconditions, a bound pod is not bound again (409 Conflict), its
        annotations are copied onto the pod."""
        meta = self.docs[name]["metadata"]
        if (
            b["metadata"].get("uid") not in (None, meta["uid"])
            or b["metadata"].get("resourceVersion") not in (None, meta["resourceVersion"])
            or self.docs[name]["spec"].get("nodeName")
        ):
            raise ApiError(409, "Conflict", b"{}")
        self.version += 1
        meta["resourceVersion"] = str(self.version)
        meta["annotations"].update(b["metadata"].get("annotations") or {})
        self.docs[name]["spec"]["nodeName"] = b["target"]["name"]
        self.writes.append(b)


@pytest.fixture
def ext() -> tuple[Extender, Pods]:
    state = ClusterState(core=None)
    state.allocator = Allocator.from_cluster(cluster(pcie_box("n0", n=2)), Config())
    pods = Pods()
    return Extender(state, core=pods, binder=pods), pods


def bind(ext: Extender, pods: Pods, doc: dict[str, Any]) -> str:
    """Creates the pod, binds it to n0 and delivers its event; bind's error."""
    pods.add(doc)
    name = doc["metadata"]["name"]
    args = {"PodName": name, "PodNamespace": "default", "PodUID": f"uid-{name}", "Node": "n0"}
    out = asyncio.run(ext.bind(args))
    ext.state.pod_event(v1pod(pods.docs[name]))
    return str(out["Error"])


def gpus_of(pods: Pods, name: str) -> list[list[str]]:
    doc = json.loads(pods.docs[name]["metadata"]["annotations"][ANNOTATION])
    return [[g["uuid"] for g in c["gpus"]] for c in doc["containers"]]


def bound_gpu(ext: Extender, pods: Pods, doc: dict[str, Any]) -> str:
    """Binds a pod of one 1-GPU container, which must succeed: its GPU."""
    assert bind(ext, pods, doc) == ""
    ((gpu,),) = gpus_of(pods, doc["metadata"]["name"])
    return gpu


def start(ext: Extender, pods: Pods, name: str, *containers: str, phase: str = "Running") -> None:
    """kubelet reports the containers started (the pod's phase as given)."""
    statuses = [
        {
            "name": c,
            "image": "busybox",
            "imageID": "",
            "ready": True,
            "restartCount": 0,
            "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
        }
        for c in containers
    ]
    pods.docs[name]["status"] = {"phase": phase, "containerStatuses": statuses}
    ext.state.pod_event(v1pod(pods.docs[name]))


def test_a_second_spread_pod_goes_to_the_first_ones_gpu(ext: tuple[Extender, Pods]) -> None:
    """Spread would put it on the idle GPU; beside a not-started 1-GPU pod it
    is placed on that pod's GPU instead, where it fits."""
    e, pods = ext
    a = bound_gpu(e, pods, pod("a", ctr(gpu=1, gpumem=4000, gpucores=30), annotations=SPREAD))
    # without the guard spread would choose the other GPU
    b_req = pod_request(pod("b", ctr(gpu=1, gpumem=4000, gpucores=30), annotations=SPREAD))
    free = e.allocator.decide(b_req, nodes=["n0"]).allocation
    assert free is not None
    assert free.containers[0].gpus[0].uuid != a
    assert bind(e, pods, pod("b", ctr(gpu=1, gpumem=4000, gpucores=30), annotations=SPREAD)) == ""
    assert gpus_of(pods, "b") == [[a]]
    assert pods.docs["b"]["spec"]["nodeName"] == "n0"


def test_a_pod_that_fits_only_elsewhere_waits_until_the_other_starts(
    ext: tuple[Extender, Pods],
) -> None:
    e, pods = ext
    a = bound_gpu(e, pods, pod("a", ctr(gpu=1, gpucores=100)))
    error = bind(e, pods, pod("b", ctr(gpu=1, gpucores=100)))
    assert error.startswith("gpuvisor: bind default/b to n0: waits for pod default/a on n0 ")
    assert "its container main" in error
    assert "1-GPU container" in error
    assert a in error
    assert "\n" not in error
    assert "nodeName" not in pods.docs["b"]["spec"]
    assert ANNOTATION not in pods.docs["b"]["metadata"]["annotations"]
    assert "default/b" not in e.state.held  # nothing reserved while it waits
    # kubelet started a's container, the pod is still Pending: b may go now
    start(e, pods, "a", "main", phase="Pending")
    b = bound_gpu(e, pods, pod("b", ctr(gpu=1, gpucores=100)))
    assert b != a


def test_a_running_pod_no_longer_counts(ext: tuple[Extender, Pods]) -> None:
    e, pods = ext
    assert bind(e, pods, pod("a", ctr(gpu=1, gpucores=100))) == ""
    start(e, pods, "a", "main")
    assert bind(e, pods, pod("b", ctr(gpu=1, gpucores=100))) == ""


def test_other_gpu_counts_and_the_same_gpus_are_not_ambiguous(
    ext: tuple[Extender, Pods],
) -> None:
    e, pods = ext
    one = bound_gpu(e, pods, pod("one", ctr(gpu=1, gpumem=1000, gpucores=10)))
    # a 2-GPU pod beside a 1-GPU one: the plugin cannot confuse them
    assert bind(e, pods, pod("two", ctr(gpu=1 + 1, gpumem=1000, gpucores=10))) == ""
    # the same GPU as the not-started 1-GPU pod: whichever the plugin
    # steers first gets the right GPU
    assert bind(e, pods, pod("same", ctr(gpu=1, gpumem=1000, gpucores=10))) == ""
    assert gpus_of(pods, "same") == [[one]]


def test_a_pod_whose_filters_exclude_the_other_gpus_is_refused(
    ext: tuple[Extender, Pods],
) -> None:
    e, pods = ext
    a = bound_gpu(e, pods, pod("a", ctr(gpu=1, gpumem=1000, gpucores=10)))
    error = bind(
        e, pods, pod("b", ctr(gpu=1, gpumem=1000), annotations={"nvidia.com/nouse-gpuuuid": a})
    )
    assert "waits for pod default/a" in error, error


def test_an_init_container_not_started_counts(ext: tuple[Extender, Pods]) -> None:
    """A pod whose init container started but not its app container still
    has a container the plugin may steer to."""
    e, pods = ext
    doc = pod("a", ctr(gpu=1, gpucores=100), init=[ctr("setup", gpu=1, gpucores=100)])
    assert bind(e, pods, doc) == ""
    start(e, pods, "a", "setup", phase="Pending")
    error = bind(e, pods, pod("b", ctr(gpu=1, gpucores=100)))
    assert "waits for pod default/a on n0 to start its container main" in error, error


def warm_pod(name: str, gpumem: int, app_gpu: bool = False) -> dict[str, Any]:
    """A pod whose plain init container has a GPU; its app container too
    (the same count: kubelet hands it the init container's devices) only
    with app_gpu."""
    main = ctr("main", gpu=1, gpumem=1000, gpucores=10) if app_gpu else ctr("main")
    return pod(name, main, init=[ctr("warm", gpu=1, gpumem=gpumem, gpucores=20)])


def test_init_containers_on_one_gpu_with_other_limits_wait(ext: tuple[Extender, Pods]) -> None:
    """PodResources lists no plain init container: the device plugin knows
    one whose devices go to no listed container only by its preference, so
    two of different pods, on one GPU, with other limits, both not started,
    would have both starts refused at every retry.  The second waits for
    the first's to start; filter leaves the node out naming it."""
    e, pods = ext
    assert bind(e, pods, warm_pod("a", 3000)) == ""
    error = bind(e, pods, warm_pod("b", 2000))
    assert error.startswith(
        "gpuvisor: bind default/b to n0: waits for pod default/a on n0 to start its container "
        "warm: both pods have an init container on "
    ), error
    assert "\n" not in error
    assert "nodeName" not in pods.docs["b"]["spec"]
    assert "default/b" not in e.state.held
    b = warm_pod("b", 2000)
    b["metadata"]["uid"] = "uid-b"
    out = e.filter({"Pod": b, "NodeNames": ["n0"]})
    assert out["NodeNames"] == []
    assert "waits for pod default/a on n0 to start its container warm" in out["FailedNodes"]["n0"]
    start(e, pods, "a", "warm", phase="Pending")
    assert e.filter({"Pod": b, "NodeNames": ["n0"]})["NodeNames"] == ["n0"]
    assert bind(e, pods, warm_pod("b", 2000)) == ""
    assert gpus_of(pods, "a") == gpus_of(pods, "b")


def test_init_containers_the_plugin_tells_apart_do_not_wait(ext: tuple[Extender, Pods]) -> None:
    """The same limits (whichever pod the plugin takes a start for, it
    writes the right limits), or an init container whose devices kubelet
    hands to an app container PodResources lists: no wait."""
    e, pods = ext
    assert bind(e, pods, warm_pod("a", 3000)) == ""
    assert bind(e, pods, warm_pod("twin", 3000)) == ""
    assert bind(e, pods, warm_pod("listed", 2000, app_gpu=True)) == ""
    assert gpus_of(pods, "a")[0] == gpus_of(pods, "twin")[0] == gpus_of(pods, "listed")[0]


def test_took_checks_under_its_lock(ext: tuple[Extender, Pods]) -> None:
    """Two decisions made before either commits (concurrent binds): the
    second to commit is refused, as the check and the commit are one step."""
    e, _ = ext
    a = e.allocator.decide(pod_request(pod("a", ctr(gpu=1, gpucores=100))), nodes=["n0"])
    assert a.allocation is not None
    taken = a.allocation.containers[0].gpus[0].uuid
    b_doc = pod("b", ctr(gpu=1, gpucores=100), annotations={"nvidia.com/nouse-gpuuuid": taken})
    b = e.allocator.decide(pod_request(b_doc), nodes=["n0"])
    e.state.took("default/a", "uid-a", "n0", a)
    with pytest.raises(Ambiguous, match="waits for pod default/a") as clash:
        e.state.took("default/b", "uid-b", "n0", b)
    assert clash.value.gpus == {frozenset([taken])}
    assert "default/b" not in e.state.held


def test_filter_leaves_out_a_node_where_the_bind_would_wait(ext: tuple[Extender, Pods]) -> None:
    """kube-scheduler is not offered a node whose bind would be refused for
    now (the pod would come back to it after every back-off): filter names
    the pod it waits for, and keeps a node where it fits on that pod's GPUs."""
    e, pods = ext
    assert bind(e, pods, pod("a", ctr(gpu=1, gpumem=1000, gpucores=50))) == ""
    b = pod("b", ctr(gpu=1, gpucores=100))
    b["metadata"]["uid"] = "uid-b"
    out = e.filter({"Pod": b, "NodeNames": ["n0"]})
    assert out["NodeNames"] == []
    assert out["FailedNodes"]["n0"].startswith(
        "waits for pod default/a on n0 to start its container main: it has a 1-GPU container"
    )
    c = pod("c", ctr(gpu=1, gpumem=1000, gpucores=50), annotations=SPREAD)
    c["metadata"]["uid"] = "uid-c"
    assert e.filter({"Pod": c, "NodeNames": ["n0"]})["NodeNames"] == ["n0"]
    start(e, pods, "a", "main")
    assert e.filter({"Pod": b, "NodeNames": ["n0"]})["NodeNames"] == ["n0"]


def test_filter_on_many_nodes_looks_past_waiting_finalists() -> None:
    """Offered more than EXPLAINED_NODES nodes, filter answers finalists; if
    they would all wait (binpack ranks first the nodes of not-started
    exclusive pods, more of them than the allocator has finalists), it
    decides again among the nodes where no not-started pod could clash."""
    state = ClusterState(core=None)
    count = EXPLAINED_NODES + 6
    nodes = [pcie_box(f"n{i:03}", n=2) for i in range(count)]
    state.allocator = Allocator.from_cluster(cluster(*nodes), Config())
    e = Extender(state, core=None, binder=None)
    names = [f"n{i:03}" for i in range(count)]
    busy = names[:20]
    for n in busy:
        a = e.allocator.decide(pod_request(pod(f"a-{n}", ctr(gpu=1, gpucores=100))), nodes=[n])
        state.took(f"default/a-{n}", f"uid-a-{n}", n, a)
    b = pod("b", ctr(gpu=1, gpucores=100))
    b["metadata"]["uid"] = "uid-b"
    first = e.allocator.decide(pod_request(b), nodes=names)
    assert first.node in busy  # binpack
    assert set(first.score["finalists"]) <= set(busy)
    out = e.filter({"Pod": b, "NodeNames": names})
    assert out["NodeNames"]
    assert not set(out["NodeNames"]) & set(busy)
    assert out["FailedNodes"][first.node].startswith(f"waits for pod default/a-{first.node}")


def test_prioritize_assumes_no_ambiguous_placement(ext: tuple[Extender, Pods]) -> None:
    """prioritize holds the chosen room until the bind, but not a placement
    the bind would move or refuse; and the node it ranks first is one filter
    answered."""
    e, pods = ext
    e.state.allocator.add_node(load_inventory(pcie_box("n1", n=2)))
    assert bind(e, pods, pod("a", ctr(gpu=1, gpucores=100))) == ""
    b = pod("b", ctr(gpu=1, gpucores=100))
    b["metadata"]["uid"] = "uid-b"
    out = e.filter({"Pod": b, "NodeNames": ["n0", "n1"]})
    assert out["NodeNames"] == ["n1"]
    scores = e.prioritize({"Pod": b, "NodeNames": ["n1"]})
    assert scores == [{"Host": "n1", "Score": 10}]
    assert e.state.held["default/b"].node == "n1"  # assumed where it may go
    c = pod("c", ctr(gpu=1, gpumem=1000, gpucores=10), annotations=SPREAD)
    c["metadata"]["uid"] = "uid-c"
    d = e.allocator.decide(pod_request(c), nodes=["n0"])
    assert d.allocation is not None
    assert d.allocation.containers[0].gpus[0].uuid == "GPU-n0-1"  # beside a's, not on it
    assert not e.state.assume("default/c", "uid-c", d)
    assert "default/c" not in e.state.held


def woken(e: Extender) -> list[Wake]:
    """Collects what the state hands its waker from now on."""
    out: list[Wake] = []
    e.state.wake = out.append
    return out


def b_refused_for_a(e: Extender, pods: Pods) -> list[Wake]:
    """Pod a (half the GPU) bound, not started; pod b (a whole GPU) refused
    by filter, to wait for a: what the state hands its waker from then on."""
    out = woken(e)
    assert bind(e, pods, pod("a", ctr(gpu=1, gpumem=1000, gpucores=50))) == ""
    b = pod("b", ctr(gpu=1, gpucores=100))
    b["metadata"]["uid"] = "uid-b"
    assert e.filter({"Pod": b, "NodeNames": ["n0"]})["NodeNames"] == []
    return out


def test_a_refused_pod_is_woken_when_the_pod_it_waits_for_starts(
    ext: tuple[Extender, Pods],
) -> None:
    """filter remembers the pod it refused to wait (kube-scheduler would
    not try it again when the other starts); the other's start wakes it,
    once.  A pod that fits is not remembered, nor is a refused pod woken by
    the bind of the one it waits for being done again."""
    e, pods = ext
    out = b_refused_for_a(e, pods)
    c = pod("c", ctr(gpu=1, gpumem=1000, gpucores=50), annotations=SPREAD)
    c["metadata"]["uid"] = "uid-c"
    assert e.filter({"Pod": c, "NodeNames": ["n0"]})["NodeNames"] == ["n0"]
    # a's bind done again (as after a failed one): dropped, decided, taken
    e.state.drop("default/a", settle=False)
    again = e.allocator.decide(pod_request(pods.docs["a"]), nodes=["n0"])
    e.state.took("default/a", "uid-a", "n0", again)
    assert out == []
    start(e, pods, "a", "main", phase="Pending")
    assert out == [Wake("default/b", "uid-b", "default/a started its container main")]
    start(e, pods, "a", "main")
    assert len(out) == 1


def test_a_refused_pod_is_woken_when_the_pod_it_waits_for_goes(
    ext: tuple[Extender, Pods],
) -> None:
    """Deleted, or replaced by another pod of the same name."""
    e, pods = ext
    out = b_refused_for_a(e, pods)
    e.state.pod_event(v1pod(pods.docs["a"]), deleted=True)
    assert out == [Wake("default/b", "uid-b", "default/a holds no GPUs any more")]
    assert e.state.blocked == {}


def test_a_pod_it_waits_for_that_started_meanwhile_wakes_it_at_once(
    ext: tuple[Extender, Pods],
) -> None:
    """The other pod's start may come between filter's check and its
    remembering the refused pod: then the pod is woken at once."""
    e, pods = ext
    out = woken(e)
    assert bind(e, pods, pod("a", ctr(gpu=1, gpumem=1000, gpucores=50))) == ""
    start(e, pods, "a", "main")
    e.state.wait_for("default/b", "uid-b", [("default/a", "main")])
    assert out == [Wake("default/b", "uid-b", "default/a started its container main")]
    assert e.state.blocked == {}


def test_bind_is_one_write(ext: tuple[Extender, Pods]) -> None:
    """The Binding carries the annotation (the API server copies it onto
    the pod) and the pod's uid and resourceVersion as preconditions."""
    e, pods = ext
    assert bind(e, pods, pod("a", ctr(gpu=1, gpumem=4000))) == ""
    assert pods.docs["a"]["spec"]["nodeName"] == "n0"
    (gpus,) = gpus_of(pods, "a")
    assert len(gpus) == 1
    assert gpus[0].startswith("GPU-n0-")
    (binding,) = pods.writes
    assert binding["metadata"]["uid"] == "uid-a"
    assert binding["metadata"]["resourceVersion"] == "1"
    assert binding["target"] == {"apiVersion": "v1", "kind": "Node", "name": "n0"}


def scheduled(e: Extender, doc: dict[str, Any]) -> str:
    """kube-scheduler's cycle for the pod as it sent it: filter, then
    prioritize on the nodes filter answered; the node ranked first."""
    out = e.filter({"Pod": doc, "NodeNames": ["n0"]})
    scores = e.prioritize({"Pod": doc, "NodeNames": out["NodeNames"]})
    return str(max(scores, key=lambda s: s["Score"])["Host"])


def bind_args(name: str, node: str = "n0") -> dict[str, str]:
    return {"PodName": name, "PodNamespace": "default", "PodUID": f"uid-{name}", "Node": node}


def test_bind_after_prioritize_reads_nothing(ext: tuple[Extender, Pods]) -> None:
    """The pod kube-scheduler sent to prioritize is bound as it was (its uid
    and resourceVersion the Binding's preconditions): no read of the pod,
    one write, the room prioritize assumed."""
    e, pods = ext
    doc = pod("a", ctr(gpu=1, gpumem=4000))
    pods.add(doc)
    assert scheduled(e, json.loads(json.dumps(doc))) == "n0"
    assumed = e.state.assumed_for["default/a"][1]
    assert asyncio.run(e.bind(bind_args("a"))) == {"Error": ""}
    assert pods.reads == 0
    assert len(pods.writes) == 1
    assert pods.docs["a"]["spec"]["nodeName"] == "n0"
    assert gpus_of(pods, "a") == [[g.uuid for g in assumed.containers[0].gpus]]
    assert e.state.held["default/a"].node == "n0"


def test_a_pod_changed_since_prioritize_is_read_and_bound(ext: tuple[Extender, Pods]) -> None:
    """The Binding of the pod as prioritize saw it gets a 409 (the pod
    changed since); bind then reads the pod and binds what it reads."""
    e, pods = ext
    doc = pod("a", ctr(gpu=1, gpumem=4000))
    pods.add(doc)
    assert scheduled(e, json.loads(json.dumps(doc))) == "n0"
    pods.docs["a"]["metadata"]["labels"] = {"changed": "yes"}  # a new resourceVersion
    pods.version += 1
    pods.docs["a"]["metadata"]["resourceVersion"] = str(pods.version)
    assert asyncio.run(e.bind(bind_args("a"))) == {"Error": ""}
    assert pods.reads == 1
    assert pods.docs["a"]["spec"]["nodeName"] == "n0"
    assert len(gpus_of(pods, "a")[0]) == 1
    assert e.state.held["default/a"].node == "n0"
    assert len(e.allocator.nodes["n0"].pods) == 1  # the room taken once


def test_a_pod_bound_since_prioritize_keeps_what_its_annotation_says(
    ext: tuple[Extender, Pods],
) -> None:
    """A pod bound meanwhile (a bind kube-scheduler gave up waiting for) is
    refused 'already bound', and what the extender holds for it is its
    annotation's placement, not the room prioritize assumed again."""
    e, pods = ext
    # the node as the watch delivers it (the state restores pods there)
    inventory = json.dumps(pcie_box("n0", n=2))
    e.state.node_event(
        view({"metadata": {"name": "n0", "annotations": {NODE_INVENTORY: inventory}}})
    )
    doc = pod("a", ctr(gpu=1, gpumem=4000))
    assert bind(e, pods, doc) == ""
    placed = gpus_of(pods, "a")
    sent = json.loads(json.dumps(pods.docs["a"]))
    del sent["spec"]["nodeName"]  # kube-scheduler's cache has it pending still
    e.state.drop("default/a")  # as if the extender had not seen the bind
    assert scheduled(e, sent) == "n0"
    out = asyncio.run(e.bind(bind_args("a")))
    assert out["Error"].endswith("already bound to n0")
    assert pods.reads == 2  # the first bind's, and this one's after the 409
    assert gpus_of(pods, "a") == placed
    held = e.allocator.nodes["n0"].pods["default/a"][0]
    assert [[g.uuid for g in c.gpus] for c in held.containers] == placed
