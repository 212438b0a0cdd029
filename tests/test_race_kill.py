"""Many processes racing for the last bytes, and processes SIGKILLed mid-call.

The workload is native/tests/t_link_churn (cuMemAlloc_v2/cuMemFree_v2 in a
tight loop, several threads) under the shim on the simulated driver.  The
simulated driver's own count of physical memory in use (NVML device memory
info, read under the simulator's lock, so a consistent snapshot) is the
independent witness: it must never pass the container's quota.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import GiB, SimNode, run_cmd, run_json, start_cmd

OBSERVER = textwrap.dedent(
    """
    import json, sys, time
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    stop = sys.argv[1]
    peak = samples = 0
    import os
    if sys.argv[2:] == ["ready"]:
        print("ready", flush=True)
    while not os.path.exists(stop):
        used = pynvml.nvmlDeviceGetMemoryInfo(h).used
        peak = max(peak, used)
        samples += 1
    print(json.dumps({"peak": peak, "samples": samples}))
    """
)


def run_linked(
    build_dir: Path, name: str, *args: str, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the C test program build/tests/<name> with args in env."""
    return run_cmd([str(build_dir / "tests" / name), *args], env, timeout)


def linked_fields(
    build_dir: Path, name: str, *args: str, env: dict[str, str], timeout: float = 60
) -> dict[str, str]:
    """run_linked, which must exit 0: the key=value fields of its output."""
    proc = run_linked(build_dir, name, *args, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(item.split("=", 1) for item in proc.stdout.split())


def start_churn(
    build_dir: Path, env: dict[str, str], seconds: float, threads: int, max_mib: int, seed: int
) -> subprocess.Popen[str]:
    churn = build_dir / "tests" / "t_link_churn"
    return start_cmd(
        [str(churn), str(seconds), str(threads), str(max_mib), str(seed), "wait"], env, stdin=True
    )


def wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    err = proc.stderr.read() if proc.stderr and not line else ""
    assert line.strip() == "ready", f"churn not ready: {line!r} {err}"


def go(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()


def observed(
    node: SimNode, tmp_path: Path, procs: list[subprocess.Popen[str]], timeout: float
) -> tuple[list[tuple[str, str]], Any]:
    """Start procs together once each is ready and OBSERVER samples the
    simulated driver's own count of device memory (on a loaded machine the
    observer's start can outlast a short churn: the churn starts only once
    it samples); wait up to timeout for each; their (stdout, stderr) and
    what the observer saw."""
    for p in procs:
        wait_ready(p)
    stop = tmp_path / "stop"
    observer = subprocess.Popen(
        [sys.executable, "-c", OBSERVER, str(stop), "ready"],
        env=node.env,
        stdout=subprocess.PIPE,
        text=True,
    )
    wait_ready(observer)
    go(procs)
    outputs = [p.communicate(timeout=timeout) for p in procs]
    stop.touch()
    return outputs, json.loads(observer.communicate(timeout=30)[0])


def region_usage(node: SimNode) -> dict[str, int]:
    code = f"""
        import json
        from gpuvisor.shim.region import Region
        r = Region.attach({str(node.region)!r})
        r.reclaim_dead()
        d = r.devices()[0]
        print(json.dumps({{"used": d.used, "limit": d.limit,
                          "procs": len(r.processes()), "oom": d.oom_count}}))
    """
    result: dict[str, int] = run_json(code, node.env)
    return result


def test_race_never_overshoots(node: SimNode, build_dir: Path, tmp_path: Path) -> None:
    """16 processes x 4 threads allocate/free up to 64 MiB blocks near a 2 GiB
    quota.  Overshoot, as the driver counts physical memory: 0 bytes."""
    limit = 2 * GiB
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT=str(limit))
    procs = [start_churn(build_dir, env, 3.0, 4, 64, seed) for seed in range(16)]
    outputs, seen = observed(node, tmp_path, procs, timeout=60)
    ok = oom = 0
    for p, (stdout, stderr) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, stderr
        fields = dict(kv.split("=") for kv in stdout.split()[-3:])
        ok += int(fields["ok"])
        oom += int(fields["oom"])
    overshoot = max(0, seen["peak"] - limit)
    print(
        f"allocations={ok} refusals={oom} samples={seen['samples']} "
        f"peak={seen['peak']} overshoot={overshoot}"
    )
    assert seen["samples"] > 10
    assert ok > 100, "the race must make progress"
    assert oom > 100, "the race must actually contend for the quota"
    assert overshoot == 0
    after = region_usage(node)
    assert after["used"] == 0
    assert after["oom"] >= oom


@pytest.mark.parametrize("rounds", [8])
def test_sigkill_storm(node: SimNode, build_dir: Path, rounds: int) -> None:
    """Workers SIGKILLed at random points, many rounds.  Survivors never hang,
    and the container's usage returns to exactly 0 every round."""
    limit = 1 * GiB
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT=str(limit))
    rng = random.Random(1234)
    kills = 0
    for r in range(rounds):
        procs = [start_churn(build_dir, env, 1.5, 3, 48, 100 * r + i) for i in range(8)]
        for p in procs:
            wait_ready(p)
        go(procs)
        victims = rng.sample(procs, k=rng.randint(2, 6))
        deadline = time.monotonic() + 1.2
        for v in victims:
            time.sleep(max(0.0, min(rng.uniform(0.0, 0.25), deadline - time.monotonic())))
            v.kill()
            kills += 1
        for p in procs:
            # A survivor blocked on a lock its killed peer held would time out here.
            p.communicate(timeout=30)
            if p not in victims:
                assert p.returncode == 0, f"survivor failed in round {r}"
        usage = region_usage(node)
        assert usage["used"] == 0, f"round {r}: {usage['used']} bytes left behind"
        assert usage["procs"] == 0
    print(f"rounds={rounds} kills={kills}")
    # After the storm the whole quota is usable again (minus the context).
    proc = run_linked(build_dir, "t_link_churn", "0.3", "1", "900", "7", env=env)
    assert proc.returncode == 0, proc.stderr


GRAPH_CHURN = textwrap.dedent(
    """
    import random, sys, time
    from tests.cuclient import *
    init()
    rng = random.Random(int(sys.argv[1]))
    s = ok(cu.cuStreamCreate, 0)
    graphs = []
    for mib in (384, 640, 896):
        ok(cu.cuStreamBeginCapture, s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
        p = ok(cu.cuMemAllocAsync, mib * MiB, s)
        ok(cu.cuMemFreeAsync, p, s)
        graphs.append(ok(cu.cuGraphInstantiate, ok(cu.cuStreamEndCapture, s), 0))
    print("ready", flush=True)
    sys.stdin.readline()
    launched = refused = 0
    for _ in range(int(sys.argv[2])):
        err = call(cu.cuGraphLaunch, rng.choice(graphs), s)[0]
        if err == SUCCESS:
            launched += 1
            time.sleep(rng.uniform(0, 0.004))      # hold it a little
        elif err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            refused += 1
        else:
            raise SystemExit(f"launch: {err}")
        ok(cu.cuDeviceGraphMemTrim, 0)
    print(f"launched={launched} refused={refused}", flush=True)
    """
)


def churn_observed(
    node: SimNode, tmp_path: Path, script: str, processes: int, limit: int
) -> tuple[list[subprocess.Popen[str]], list[tuple[str, str]], Any]:
    """Run `processes` copies of a churn script (seeds 0..n-1, 150 rounds)
    in one container with a memory limit, started together once each is
    ready, while OBSERVER samples the simulated driver's own count of device
    memory; returns the processes, their (stdout, stderr) and what the
    observer saw."""
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT=str(limit))
    procs = [
        start_cmd([sys.executable, "-c", script, str(seed), "150"], env, stdin=True)
        for seed in range(processes)
    ]
    outputs, seen = observed(node, tmp_path, procs, timeout=120)
    return procs, outputs, seen


def test_graph_memory_race_never_overshoots(node: SimNode, tmp_path: Path) -> None:
    """Six processes launch graphs that allocate 384-896 MiB (and trim after
    each launch) under a 2 GiB quota.  The simulated driver's own count of
    device memory in use never passes the quota, and everything comes back."""
    limit = 2 * GiB
    procs, outputs, seen = churn_observed(node, tmp_path, GRAPH_CHURN, 6, limit)
    launched = refused = 0
    for p, (stdout, stderr) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, stderr
        fields = dict(kv.split("=") for kv in stdout.split()[-2:])
        launched += int(fields["launched"])
        refused += int(fields["refused"])
    print(f"launched={launched} refused={refused} peak={seen['peak']} samples={seen['samples']}")
    assert seen["samples"] > 10
    assert launched > 50, "the race must make progress"
    assert refused > 10, "the race must actually contend for the quota"
    assert seen["peak"] <= limit
    after = region_usage(node)
    assert after["used"] == 0, after


AUTO_FREE_CHURN = textwrap.dedent(
    """
    import random, sys, time
    from tests.cuclient import *
    init()
    rng = random.Random(int(sys.argv[1]))
    s = ok(cu.cuStreamCreate, 0)
    g = ok(cu.cuGraphCreate, 0)
    dptr = add_alloc_node(g, rng.choice((384, 640, 896)) * MiB)
    auto = cu.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH
    e = ok(cu.cuGraphInstantiate, g, auto)
    print("ready", flush=True)
    sys.stdin.readline()
    launched = refused = refused_live = 0
    live = False
    for _ in range(int(sys.argv[2])):
        err = call(cu.cuGraphLaunch, e, s)[0]
        if err == SUCCESS:
            launched += 1
            live = True
            time.sleep(rng.uniform(0, 0.003))      # hold it a little
        elif err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            refused += 1
            refused_live += live
        else:
            raise SystemExit(f"launch: {err}")
        r = rng.random()
        if live and r < 0.35:                     # give it back to the others
            if r < 0.2:
                ok(cu.cuMemFree, dptr)
            else:
                ok(cu.cuMemFreeAsync, dptr, s)
                ok(cu.cuStreamSynchronize, s)
            live = False
            ok(cu.cuDeviceGraphMemTrim, 0)
        elif r < 0.45:
            ok(cu.cuDeviceGraphMemTrim, 0)        # keeps what is live
    print(f"launched={launched} refused={refused} refused_live={refused_live}", flush=True)
    """
)


def test_auto_free_graph_relaunch_race_never_overshoots(node: SimNode, tmp_path: Path) -> None:
    """Five processes of one container relaunch auto-free graphs of 384-896
    MiB under a 2 GiB quota, now and then freeing their allocation and
    trimming the pool, which lets the others in.  A relaunch while its own
    allocation is live needs nothing more (the driver frees it first) and is
    never refused; the simulated driver's count of device memory in use
    never passes the quota; everything comes back.  Relaunches used to be
    charged again for the live allocation, and refused."""
    limit = 2 * GiB
    procs, outputs, seen = churn_observed(node, tmp_path, AUTO_FREE_CHURN, 5, limit)
    totals = {"launched": 0, "refused": 0, "refused_live": 0}
    for p, (stdout, stderr) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, stderr
        fields = dict(kv.split("=") for kv in stdout.split()[-3:])
        for k in totals:
            totals[k] += int(fields[k])
    print(f"{totals} peak={seen['peak']} samples={seen['samples']}")
    assert seen["samples"] > 10
    assert totals["launched"] > 100, "the race must make progress"
    assert totals["refused"] > 10, "the race must actually contend for the quota"
    assert totals["refused_live"] == 0, totals
    assert seen["peak"] <= limit
    assert region_usage(node)["used"] == 0


@pytest.mark.parametrize("free", ["async", "sync"])
def test_a_block_freed_while_its_pool_is_destroyed_stays_counted(
    node: SimNode, build_dir: Path, free: str
) -> None:
    """One thread frees block A of a pool (cuMemFreeAsync or cuMemFree) while
    another destroys the pool; block B is still allocated, so the driver
    keeps the pool's memory for it, and the quota must too.  Before, a free
    that had taken A's record but not yet reached the pool's lock was left
    out of the destroy's count of outstanding blocks: the pool's whole
    charge went back with A's free, in about 2 % of rounds, while B was
    still held."""
    proc = run_linked(
        build_dir,
        "t_link_pool_race",
        "3000",
        free,
        env=node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g"),
        timeout=120,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rounds=3000 low=0 leaked=0" in proc.stdout
    assert region_usage(node)["used"] == 0


def test_a_thread_allocating_while_untracked_memory_is_reread_is_still_counted(
    node: SimNode, build_dir: Path
) -> None:
    """Memory the driver gives without an allocation call (here a 1 GiB
    device heap) is charged from NVML's per-process figure.  A reading taken
    while another thread's allocation is in the driver (charged, not yet in
    NVML) used to drop the heap's charge by that allocation's size, and a
    third allocation then passed the quota: 3000 MiB next to the 1 GiB heap
    and 1 GiB in flight under 4 GiB.  Now no reading is taken while a charge
    is in flight."""
    out = linked_fields(
        build_dir,
        "t_link_untracked_race",
        env=node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g", GPUVISOR_SIM_ALLOC_MS="2000"),
    )
    assert out["a"] == "0", out
    assert out["b"] == "2", out  # CUDA_ERROR_OUT_OF_MEMORY
    assert int(out["used_mib"]) >= 2048, out


@pytest.mark.parametrize("made", ["create", "primary"])
def test_a_context_is_charged_its_own_memory_while_another_thread_allocates(
    node: SimNode, build_dir: Path, made: str
) -> None:
    """A context is charged what NVML shows its process took while it was
    made.  Another thread of the process that allocates meanwhile (1 GiB
    here) is charged for that on its own: the context used to be charged it
    too, and kept it after the free (1088 MiB left for two 32 MiB
    contexts)."""
    out = linked_fields(
        build_dir,
        "t_link_ctx_race",
        made,
        env=node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g", GPUVISOR_SIM_CTX_CREATE_MS="1000"),
    )
    assert out == {"after_free_mib": "64"}


@pytest.mark.parametrize(
    "freed", ["destroy", "primary", "reset", "release", "unmap", "addrfree", "async"]
)
def test_memory_freed_while_untracked_memory_is_reread_is_not_taken_off_it(
    node: SimNode, build_dir: Path, freed: str
) -> None:
    """A free takes time in the driver (here 1 s, GPUVISOR_SIM_FREE_MS), and
    NVML shows the memory gone before the driver call answers and the quota
    gets it back.  A reading of NVML in that time, to charge memory the
    driver gave without an allocation call (a 1 GiB device heap), used to
    take the freed object off the heap's charge: once the free was back,
    the container's usage was short by the object's size (256 MiB for a
    context, 512 MiB for a VMM handle or a block) until the next reading,
    which waits while another thread's allocation is in the driver.  Now a
    free is in flight for its whole driver call, and no reading is taken
    then."""
    out = linked_fields(
        build_dir,
        "t_link_free_race",
        freed,
        env=node.shimmed(
            CUDA_DEVICE_MEMORY_LIMIT="4g",
            GPUVISOR_SIM_DEVICES="2x16g:ctx=256m",
            GPUVISOR_SIM_FREE_MS="1000",
            GPUVISOR_SIM_ALLOC_MS="1500",
        ),
    )
    assert (out["a"], out["b"], out["c"]) == ("0", "2", "0"), out
    # the context, the heap and C's 64 MiB
    assert out["during"] == out["after"] == str(256 + 1024 + 64), out


@pytest.mark.parametrize("sync", ["stream", "ctx", "event", "ptsz"])
def test_a_pool_shrunk_by_a_synchronisation_is_not_taken_off_untracked_memory(
    node: SimNode, build_dir: Path, sync: str
) -> None:
    """A synchronisation gives a pool's reserve above its release threshold
    back (512 MiB here, threshold 0), and NVML shows it gone before the
    synchronisation returns (1.2 s here, GPUVISOR_SIM_FREE_MS).  The pool's
    charge used to follow only at the next re-read of the pool: until then
    the container was charged 512 MiB too much, and a reading of NVML for
    memory the driver gave without an allocation call (a 1 GiB device heap),
    taken by another thread's allocation meanwhile, took the 512 MiB off the
    heap's charge; once the pool's charge followed, the container's usage
    was 512 MiB short.  Now the pools are settled before each reading (and
    no reading is used while one is charged more than its reserve), and
    after each synchronisation."""
    fields = linked_fields(
        build_dir,
        "t_link_pool_sync_race",
        sync,
        env=node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g", GPUVISOR_SIM_FREE_MS="1200"),
    )
    out = {k: int(v) for k, v in fields.items()}
    base = 32 + 1024  # the context and the heap
    assert out["synced_a"] == base, out
    assert out["n"] > 0, out
    assert out["synced"] == out["after"] == base + 2 * out["n"], out
    assert out["low"] == 0, out


@pytest.mark.parametrize(
    "reached", ["sync", "ctxsync", "event", "ptsz", "poll", "destroy", "sdestroy"]
)
def test_a_block_freed_into_a_busy_stream_stays_charged_until_the_stream_gets_there(
    node: SimNode, build_dir: Path, reached: str
) -> None:
    """cuMemFreeAsync of a cuMemAlloc block: the driver frees it when the
    stream reaches the free.  Its charge used to go back at once, so with a
    1 s kernel ahead of the free, a 512 MiB allocation passed a 1 GiB quota
    next to the 768 MiB block still there.  Now it is refused while the free
    is pending, and the charge goes back with the synchronisation that shows
    the stream got there (or, with none, at the next allocation after it
    did; or with the stream's context).  A stream destroyed once it got
    there (sdestroy) releases it too: another process of the container then
    gets its 512 MiB with no further call from this one (cuStreamDestroy
    was not hooked, and the charge stayed until this process's next hook)."""
    out = linked_fields(
        build_dir, "t_link_free_async", reached, env=node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g")
    )
    contexts = 64 if reached == "destroy" else 32
    assert out["pending"] == "2", out  # CUDA_ERROR_OUT_OF_MEMORY
    assert int(out["during"]) == contexts + 768, out
    # gv_device_get_used gives nothing back itself: with no synchronisation,
    # the block is released by the allocation that follows.
    assert int(out["synced"]) == (32 + 768 if reached == "poll" else 32), out
    # the other process (sdestroy only) got its 512 MiB
    assert out.get("take") == ("0" if reached == "sdestroy" else None), out
    assert out["after"] == "0", out
    assert region_usage(node)["used"] == 0


@pytest.mark.parametrize(
    "query", ["query", "ptszquery", "evquery", "procaddr", "procaddr_ptsz", "dlsym"]
)
def test_a_query_that_finds_the_stream_done_releases_its_pending_free(
    node: SimNode, build_dir: Path, query: str
) -> None:
    """A cuMemFreeAsync'd cuMemAlloc block (768 MiB, behind a 1 s kernel,
    under a 1 GiB quota) is freed by the driver once the stream gets
    there, and cuStreamQuery (_ptsz) or cuEventQuery answering
    CUDA_SUCCESS proves it did.  Those were not hooked: a program that
    polled them instead of synchronising kept the block's charge until its
    own next allocation, and another process of the container was refused
    512 MiB that fit.  Now the query releases it, whether called by name,
    through cuGetProcAddress (with or without the per-thread stream flag)
    or through dlsym."""
    out = linked_fields(
        build_dir, "t_link_free_async", query, env=node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g")
    )
    assert out["pending"] == "2", out  # CUDA_ERROR_OUT_OF_MEMORY
    assert int(out["during"]) == 32 + 768, out
    assert int(out["polls"]) > 1, out  # the stream was busy at first
    assert int(out["synced"]) == 32, out
    assert out["take"] == "0", out  # the other process got its 512 MiB
    assert out["after"] == "0", out
    assert region_usage(node)["used"] == 0


def test_more_pending_frees_than_the_table_holds_wait_for_their_stream(
    node: SimNode, build_dir: Path
) -> None:
    """300 blocks freed behind a 1 s kernel: 256 wait in the table of
    pending frees; the next free, finding it full, waits for its stream
    itself (so its charge is never given back early), and the rest find
    the table emptied.  Everything is back after a synchronisation."""
    proc = run_linked(
        build_dir, "t_link_free_async", "many", env=node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g")
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "many blocked=1 used=32", proc.stdout
    assert "more than 256 stream-ordered frees" in proc.stderr
