"""`gpuvisor webhook`: the mutating admission webhook for GPU pods (docs/kubernetes.md)."""
