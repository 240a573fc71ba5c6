# InferMesh image: the model server (and, in later releases, the control plane).
# CPU by default; onnxruntime-gpu in the image also runs on CUDA hosts when the container gets a
# GPU (compose profile "gpu"), because the wheel ships the CUDA execution provider.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY model_server model_server
COPY control_plane control_plane
COPY tools tools
COPY infermesh infermesh
RUN INFERMESH_VENV=/opt/infermesh INFERMESH_INSTALL=/src bash tools/install.sh \
 && /opt/infermesh/bin/python -m model_server.demo_models --out /models

FROM python:3.11-slim
RUN useradd --uid 10001 --create-home infermesh
COPY --from=build /opt/infermesh /opt/infermesh
COPY --from=build --chown=infermesh /models /models
ENV PATH=/opt/infermesh/bin:$PATH PYTHONUNBUFFERED=1
USER infermesh
EXPOSE 8001 9001
ENTRYPOINT ["infermesh-model-server"]
CMD ["--host", "0.0.0.0", "--port", "8001", "--model-repository", "/models"]
