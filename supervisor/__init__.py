"""gpuvisor.supervisor: the container entrypoint (`gpuvisor run`), the node
agent (`gpuvisor node-agent`) and the human views (`status`, `top`)."""
