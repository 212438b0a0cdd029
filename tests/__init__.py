"""gpuvisor's test suite (and the demos built on it: tests/demo_cluster.py).

gRPC's fork support off, before any test module imports grpc: the tests
fork only to exec (subprocess with preexec_fn, for PR_SET_PDEATHSIG), while
the kubelet harness's gRPC server and clients run in other threads.  With
it on, the child of such a fork ran gRPC's post-fork handler, which starts
a poller thread, and closing the child's descriptors before exec broke that
thread's epoll descriptor: the child aborted ("epoll_wait error: Bad file
descriptor", SIGABRT) before exec, in 7 of 300 forks here with grpcio
1.85.3 (grpc/grpc#43055; a CI run lost `gpuvisor device-plugin` so), 0 of
300 with it off.  The product's processes never fork after using gRPC."""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
