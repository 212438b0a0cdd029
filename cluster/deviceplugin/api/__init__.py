"""kubelet's device plugin and PodResources APIs: the .proto files and the Python
modules generated from them (generate.py)."""
