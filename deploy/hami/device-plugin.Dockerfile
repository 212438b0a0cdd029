# syntax=docker/dockerfile:1
#
# HAMi's device-plugin image with libgpuvisor.so in place of HAMi-core's
# libvgpu.so.  Use it together with libgpuvisor-installer.yaml.
#
# Why: the device plugin's postStart hook (HAMi docker/vgpu-init.sh) copies
# its image's /k8s-vgpu/lib/nvidia/* to the host's /usr/local/vgpu/ whenever
# the md5 differs, with cp, i.e. rewriting the host file in place.  With the
# stock image every restart of the plugin would rewrite libgpuvisor.so, which
# running containers have mapped, with HAMi-core's bytes.  With this image
# the files already match and the hook leaves them alone.
#
#   docker build -f deploy/hami/device-plugin.Dockerfile \
#       --build-arg HAMI_IMAGE=projecthami/hami:v2.10.0 \
#       -t projecthami-hami-gpuvisor:v2.10.0 deploy/hami
#
# then point HAMi's Helm values at it (devicePlugin.image.registry /
# repository / tag).  HAMI_IMAGE must be the tag your HAMi release runs:
# the library is stored under that release's versioned file name.

ARG HAMI_IMAGE=projecthami/hami:v2.10.0
ARG GPUVISOR_RUNTIME_IMAGE=gpuvisor/runtime:0.1.0

FROM ${GPUVISOR_RUNTIME_IMAGE} AS gpuvisor

FROM ${HAMI_IMAGE} AS device-plugin
COPY --from=gpuvisor /usr/local/lib/gpuvisor/libgpuvisor.so /tmp/libgpuvisor.so
# Every libvgpu.so file the hook installs (libvgpu.so.<version>, and a plain
# libvgpu.so if the image has one) becomes libgpuvisor.so; fail if none.
RUN set -eu; \
    found=0; \
    for f in /k8s-vgpu/lib/nvidia/libvgpu.so /k8s-vgpu/lib/nvidia/libvgpu.so.*; do \
      [ -f "$f" ] || continue; \
      cp /tmp/libgpuvisor.so "$f"; \
      echo "replaced $f"; \
      found=1; \
    done; \
    rm -f /tmp/libgpuvisor.so; \
    [ "$found" = 1 ] || { echo "no libvgpu.so in /k8s-vgpu/lib/nvidia" >&2; exit 1; }
