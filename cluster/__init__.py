"""gpuvisor.cluster: the cluster half of gpuvisor.

What lives here, as it is built (each part a module or subpackage):

- the node inventory: the GPUs of a node, how each pair is connected and
  their MIG state, read through NVML (real or simulated) and written as a
  versioned JSON document (`gpuvisor inventory`);
- the allocator: HAMi's request language (`nvidia.com/gpu`, `gpumem`,
  `gpucores`, type and UUID annotations, binpack and spread, topology and MIG)
  decided as a pure function of the cluster's state (`gpuvisor place`);
- the Kubernetes components that call it: a kubelet device plugin, a
  kube-scheduler extender and a mutating admission webhook.

Nothing here runs inside a container: the in-container half is
`gpuvisor.shim` and `gpuvisor.supervisor`.
"""
