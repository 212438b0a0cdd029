"""`gpuvisor scheduler`: the kube-scheduler extender (filter, prioritize, bind)."""
