"""kubelet device plugin (`gpuvisor device-plugin`)."""
